# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb. The bug: the shard size rounds down (sum // N), as if N always
# divided the unit: the last elements of a unit belong to nobody. The real checkpoint was written by 3 ranks and no
# unit of the GPT divides by 3, so its metadata shows it too.
# EXPECT FAIL: shard_pieces

# ANSWER: shard_pieces
def shard_pieces(numels, N):
    S = sum(numels) // N
    out, offset = [], 0
    for n in numels:
        pieces = []
        for q in range(N):
            first, last = max(q * S, offset), min((q + 1) * S, offset + n)
            if first < last:
                pieces.append((q, first - offset, last - offset))
        out.append(pieces)
        offset += n
    return out
