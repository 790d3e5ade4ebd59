# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: every box of a
# matrix read row by row, the way a block of columns must be read. Each element is read once and nothing else, but a
# block of whole rows (q, k, v, gate, up, the embedding and the head) lies in one range of the flattened tensor:
# reading it in one piece's range costs one read, not one per row.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, box, read):
    if len(shape) == 1:
        runs = [box[0]]
    else:
        (r0, r1), (c0, c1) = box
        runs = [(i * shape[1] + c0, i * shape[1] + c1) for i in range(r0, r1)]
    parts = []
    for a, b in runs:
        for piece in sorted(pieces, key=lambda p: p["flat"][0]):
            lo, hi = max(a, piece["flat"][0]), min(b, piece["flat"][1])
            if lo < hi:
                parts.append(read(piece["rank"], lo, hi))
    return torch.cat(parts).view([b - a for a, b in box])
