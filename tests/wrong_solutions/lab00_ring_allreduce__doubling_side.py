# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug (in the any-P solution's exchanges among the largest power of two of ranks):
# in the doubling phase the partner's block is always put after this rank's own, even when the
# partner is the lower rank and its block comes first. The halving phase and every partner are right; but the
# received block is read as the wrong chunks: where chunks differ in length (N=1001 on 3 ranks) the receive is sized
# wrong and gloo aborts the run, elsewhere the sum comes out wrong.
# EXPECT FAIL: halving_doubling

# ANSWER: halving_doubling
def halving_doubling_all_reduce(x: torch.Tensor) -> torch.Tensor:
    P, r = dist.get_world_size(), dist.get_rank()
    Q = 1 << (P.bit_length() - 1)  # the largest power of two <= P
    x = x.clone()
    if r >= Q:  # beyond Q: hand x to rank r - Q, get the total back (one round with one partner)
        comm.wait_all([comm.isend(x, r - Q)])
        comm.wait_all([comm.irecv(x, r - Q)])
        return x
    if r + Q < P:  # fold in: rank r + Q's contribution, before the exchanges start
        incoming = torch.empty_like(x)
        comm.wait_all([comm.irecv(incoming, r + Q)])
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
        theirs = range(hi, hi + d) if hi + d <= Q else range(lo - d, lo)  # "after mine", unless it does not fit
        for c, part in zip(theirs, exchange(r ^ d, range(lo, hi), theirs), strict=True):
            chunks[c] = part
        lo, hi = min(lo, theirs.start), max(hi, theirs.stop)
        d *= 2
    out = torch.cat(chunks)
    if r + Q < P:  # fold out: the total back to rank r + Q
        comm.wait_all([comm.isend(out, r + Q)])
    return out
