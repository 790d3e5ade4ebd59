# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: textbook recursive halving/doubling (partner r ^ d, the block halved each step), which needs
# P a power of two: on 8 ranks every line passes; on 3 ranks the halves of a block of 3 chunks differ in size between
# the partners (and rank 2's partner would be rank 3): gloo aborts the run on a size mismatch.
# EXPECT FAIL: halving_doubling

# ANSWER: halving_doubling
def halving_doubling_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x: [N] on every rank, P a power of two -> the sum over ranks, [N], on every rank."""
    P, r = dist.get_world_size(), dist.get_rank()
    chunks = [c.clone() for c in x.tensor_split(P)]  # chunk c: [N/P]

    def exchange(partner: int, outgoing: range, into: range) -> list[torch.Tensor]:
        """Send chunks `outgoing` (one message), receive one message the size of chunks `into`, split per chunk."""
        message = torch.cat([chunks[c] for c in outgoing])
        incoming = torch.empty(sum(len(chunks[c]) for c in into), dtype=x.dtype, device=x.device)
        comm.wait_all([comm.isend(message, partner), comm.irecv(incoming, partner)])
        return list(incoming.split([len(chunks[c]) for c in into]))

    lo, hi = 0, P  # this rank's block: chunks [lo, hi)
    d = P // 2
    while d >= 1:  # halving: the partner is d away; the bit d of r decides which half this rank keeps
        mid = (lo + hi) // 2
        keep, give = (range(lo, mid), range(mid, hi)) if r & d == 0 else (range(mid, hi), range(lo, mid))
        for c, part in zip(keep, exchange(r ^ d, give, keep), strict=True):
            chunks[c] += part  # one more group of ranks' partial sum
        lo, hi = keep.start, keep.stop
        d //= 2
    d = 1  # now [lo, hi) is [r, r + 1): chunk r is finished
    while d < P:  # doubling: the partner's finished block sits next to this rank's
        theirs = range(lo ^ d, (lo ^ d) + d)
        for c, part in zip(theirs, exchange(r ^ d, range(lo, hi), theirs), strict=True):
            chunks[c] = part
        lo, hi = min(lo, theirs.start), max(hi, theirs.stop)
        d *= 2
    return torch.cat(chunks)
