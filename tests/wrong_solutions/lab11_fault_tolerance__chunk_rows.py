# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb. The bug: the rows are cut as torch.chunk cuts them (ceil(R / M)
# rows a rank, the last rank what is left), not by the lab's convention. With M = 2 every row count divides and it
# is right; with M = 3 the ranks hold the wrong rows (16 rows: 6, 6, 4 instead of 5, 5, 6). Put back together, the
# rows still make the whole tensors: only the per-rank shapes give it away.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, M, r, read):
    if len(shape) == 1:
        lo, hi, rows = 0, shape[0], None
    else:
        C = math.prod(shape[1:])
        step = -(-shape[0] // M)
        first, end = min(r * step, shape[0]), min((r + 1) * step, shape[0])
        lo, hi, rows = first * C, end * C, end - first
    out = torch.zeros(hi - lo, dtype=torch.float64)
    for piece in pieces:
        a, b = piece["flat"]
        x, y = max(a, lo), min(b, hi)
        if x < y:
            out[x - lo : y - lo] = read(piece["rank"])[x - a : y - a]
    return out if rows is None else out.view(rows, *shape[1:])
