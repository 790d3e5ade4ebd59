# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb. The bug: every rank reads every saved piece (it assembles each
# whole tensor, then cuts out its rows). The numbers are right; each rank reads the whole checkpoint, which at scale
# is M times the bytes it needs, from every other rank's file.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, M, r, read):
    flat = torch.zeros(math.prod(shape), dtype=torch.float64)
    for piece in pieces:
        a, b = piece["flat"]
        flat[a:b] = read(piece["rank"])
    full = flat.view(*shape)
    if len(shape) == 1:
        return full
    R = shape[0]
    return full[r * R // M : (r + 1) * R // M].clone()
