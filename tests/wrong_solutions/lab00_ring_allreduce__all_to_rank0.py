# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The design: the ranks beyond the largest power of two Q all hand x to rank 0,
# which adds them in before halving/doubling on Q ranks and sends them the total after. On 3 and 5 ranks (one extra
# rank) it is right; on 6 ranks rank 0 talks to two extra ranks: two rounds and one copy of x too many on it.
# EXPECT FAIL: halving_doubling

# ANSWER: halving_doubling
def halving_doubling_all_reduce(x: torch.Tensor) -> torch.Tensor:
    P, r = dist.get_world_size(), dist.get_rank()
    Q = 1 << (P.bit_length() - 1)  # the largest power of two <= P
    x = x.clone()
    if r >= Q:  # beyond Q: hand x to rank 0, get the total back
        comm.wait_all([comm.isend(x, 0)])
        comm.wait_all([comm.irecv(x, 0)])
        return x
    if r == 0:  # rank 0 takes in every extra rank's x
        for q in range(Q, P):
            incoming = torch.empty_like(x)
            comm.wait_all([comm.irecv(incoming, q)])
            x += incoming
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
    if r == 0:
        comm.wait_all([comm.isend(out, q) for q in range(Q, P)])
    return out
