# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: every box taken
# for a block of whole rows, one range of the flattened tensor, as column-parallel boxes are. Row-parallel matrices
# (o, down) are cut by columns: their boxes span every row, so this reads the whole matrix and returns it, a shape
# the box does not have.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, box, read):
    (first, end) = box[0]
    row = math.prod(shape[1:])
    lo, hi = first * row, end * row
    out = torch.zeros(hi - lo, dtype=torch.float64)
    for piece in pieces:
        a, b = piece["flat"]
        x, y = max(a, lo), min(b, hi)
        if x < y:
            out[x - lo : y - lo] = read(piece["rank"], x, y)
    return out.view(end - first, *shape[1:])
