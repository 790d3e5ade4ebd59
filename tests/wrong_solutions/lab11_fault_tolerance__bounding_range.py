# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: a box read as
# the range of the flattened tensor from its first element to its last, then cut. For rows and vectors that is the
# box; for a block of columns (o and down, cut by columns) the range holds every other rank's columns between the
# rows too: the numbers are right and only the pieces that overlap the box are opened, but each rank reads about M
# times the elements it needs.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, box, read):
    index = torch.arange(math.prod(shape)).view(shape)[tuple(slice(a, b) for a, b in box)]
    lo, hi = int(index.min()), int(index.max()) + 1  # the bounding range
    span = torch.empty(hi - lo, dtype=torch.float64)
    for piece in pieces:
        a, b = max(lo, piece["flat"][0]), min(hi, piece["flat"][1])
        if a < b:
            span[a - lo : b - lo] = read(piece["rank"], a, b)
    return span[index - lo]
