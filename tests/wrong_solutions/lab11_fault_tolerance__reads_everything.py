# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: every rank
# reads every saved piece whole (it assembles each whole tensor, then cuts out its box). The numbers are right; each
# rank reads the whole checkpoint, which at scale is M times the bytes it needs, from every other rank's file.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, box, read):
    flat = torch.zeros(math.prod(shape), dtype=torch.float64)
    for piece in pieces:
        a, b = piece["flat"]
        flat[a:b] = read(piece["rank"], a, b)
    return flat.view(shape)[tuple(slice(a, b) for a, b in box)].clone()
