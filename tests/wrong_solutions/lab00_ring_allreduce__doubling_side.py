# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: in the doubling phase the partner's block is always put after this rank's own, even when the
# partner is the lower rank and its block comes first. The halving phase and every partner are right, and every
# message is whole finished chunks; but half the finished blocks land in the wrong place, and the sum comes out wrong.
# EXPECT FAIL: halving_doubling

# ANSWER: halving_doubling
def halving_doubling_all_reduce(x: torch.Tensor) -> torch.Tensor:
    P, r = dist.get_world_size(), dist.get_rank()
    chunks = [c.clone() for c in x.tensor_split(P)]

    def exchange(partner, outgoing, into):
        message = torch.cat([chunks[c] for c in outgoing])
        incoming = torch.empty(sum(len(chunks[c]) for c in into), dtype=x.dtype)
        comm.wait_all([comm.isend(message, partner), comm.irecv(incoming, partner)])
        return list(incoming.split([len(chunks[c]) for c in into]))

    lo, hi = 0, P
    d = P // 2
    while d >= 1:
        mid = (lo + hi) // 2
        keep, give = (range(lo, mid), range(mid, hi)) if r & d == 0 else (range(mid, hi), range(lo, mid))
        for c, part in zip(keep, exchange(r ^ d, give, keep)):
            chunks[c] += part
        lo, hi = keep.start, keep.stop
        d //= 2
    d = 1
    while d < P:
        theirs = range(hi, hi + d) if hi + d <= P else range(lo - d, lo)  # "after mine", unless it does not fit
        for c, part in zip(theirs, exchange(r ^ d, range(lo, hi), theirs)):
            chunks[c] = part
        lo, hi = min(lo, theirs.start), max(hi, theirs.stop)
        d *= 2
    return torch.cat(chunks)
