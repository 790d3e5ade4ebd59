# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The design: halving/doubling where P is a power of two, the ring all-reduce
# elsewhere. The sums and the bytes are right everywhere (the ring's 2(P-1)/P N is within the budget), but each ring
# step sends to one neighbour and receives from the other: two rounds a step, 4(P-1) rounds in all, far over the
# budget on 3, 5 and 6 ranks.
# EXPECT FAIL: halving_doubling

# ANSWER: halving_doubling
def halving_doubling_all_reduce(x: torch.Tensor) -> torch.Tensor:
    P, r = dist.get_world_size(), dist.get_rank()
    if P & (P - 1):  # not a power of two: the ring all-reduce, bandwidth-optimal too
        chunks = [c.clone() for c in x.tensor_split(P)]
        right, left = (r + 1) % P, (r - 1) % P
        for s in range(P - 1):
            incoming = torch.empty_like(chunks[(r - s - 1) % P])
            comm.wait_all([comm.isend(chunks[(r - s) % P], right), comm.irecv(incoming, left)])
            chunks[(r - s - 1) % P] += incoming
        for s in range(P - 1):
            incoming = torch.empty_like(chunks[(r - s) % P])
            comm.wait_all([comm.isend(chunks[(r + 1 - s) % P], right), comm.irecv(incoming, left)])
            chunks[(r - s) % P] = incoming
        return torch.cat(chunks)
    Q = 1 << (P.bit_length() - 1)  # the largest power of two <= P
    x = x.clone()
    chunks = [c.clone() for c in x.tensor_split(Q)]

    def exchange(partner: int, outgoing: range, into: range) -> list[torch.Tensor]:
        message = torch.cat([chunks[c] for c in outgoing])
        incoming = torch.empty(sum(len(chunks[c]) for c in into), dtype=x.dtype, device=x.device)
        comm.wait_all([comm.isend(message, partner), comm.irecv(incoming, partner)])
        return list(incoming.split([len(chunks[c]) for c in into]))

    lo, hi, d = 0, Q, Q // 2
    while d >= 1:
        mid = (lo + hi) // 2
        keep, give = (range(lo, mid), range(mid, hi)) if r & d == 0 else (range(mid, hi), range(lo, mid))
        for c, part in zip(keep, exchange(r ^ d, give, keep), strict=True):
            chunks[c] += part
        lo, hi = keep.start, keep.stop
        d //= 2
    d = 1
    while d < Q:
        theirs = range(lo ^ d, (lo ^ d) + d)
        for c, part in zip(theirs, exchange(r ^ d, range(lo, hi), theirs), strict=True):
            chunks[c] = part
        lo, hi = min(lo, theirs.start), max(hi, theirs.stop)
        d *= 2
    out = torch.cat(chunks)
    return out
