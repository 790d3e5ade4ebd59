# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: halving pairs the nearest ranks first (partner r ^ 1, then r ^ 2, ...) while splitting the
# block into its lower and upper halves, bit by bit from the lowest. Each pair is consistent and the doubling phase
# undoes it exactly, so every rank ends with the right sum; but after halving rank r holds the chunk whose index is r
# with its bits reversed (rank 1 holds chunk 2 of 4), not chunk r: the FAIL line shows the first finished block a
# rank sends, which is not its own chunk.
# EXPECT FAIL: halving_doubling

# ANSWER: halving_doubling
def halving_doubling_all_reduce(x: torch.Tensor) -> torch.Tensor:
    P, r = dist.get_world_size(), dist.get_rank()
    chunks = [c.clone() for c in x.tensor_split(P)]

    def exchange(partner, outgoing, into):
        message = torch.cat([chunks[c] for c in outgoing])
        incoming = torch.empty(sum(len(chunks[c]) for c in into), dtype=x.dtype, device=x.device)
        comm.wait_all([comm.isend(message, partner), comm.irecv(incoming, partner)])
        return list(incoming.split([len(chunks[c]) for c in into]))

    lo, hi, d, blocks = 0, P, 1, []
    while d < P:  # halving, nearest partner first
        mid = (lo + hi) // 2
        keep, give = (range(lo, mid), range(mid, hi)) if r & d == 0 else (range(mid, hi), range(lo, mid))
        for c, part in zip(keep, exchange(r ^ d, give, keep)):
            chunks[c] += part
        blocks.append((d, give))
        lo, hi = keep.start, keep.stop
        d *= 2
    for d, give in reversed(blocks):  # doubling: the same partners in reverse, each gets back what it kept
        for c, part in zip(give, exchange(r ^ d, range(lo, hi), give)):
            chunks[c] = part
        lo, hi = min(lo, give.start), max(hi, give.stop)
    return torch.cat(chunks)
