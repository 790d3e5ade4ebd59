# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: every piece that overlaps
# the box read whole and cut afterwards. The values are right, but the rows layout's ranks read all of each piece they
# touch: elements outside their box.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, box, read):
    whole = None
    for piece in pieces:
        saved = piece["box"]
        if any(max(a, sa) >= min(b, sb) for (a, b), (sa, sb) in zip(box, saved)):
            continue
        values = read(piece["rank"], 0, math.prod(b - a for a, b in saved)).view([b - a for a, b in saved])
        whole = torch.zeros(shape, dtype=values.dtype) if whole is None else whole
        whole[tuple(slice(a, b) for a, b in saved)] = values
    return whole[tuple(slice(a, b) for a, b in box)].clone()
