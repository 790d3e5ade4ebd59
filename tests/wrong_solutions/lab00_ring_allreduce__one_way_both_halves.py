# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: every chunk cut in two halves, each half its own ring, but both rings run the same way round
# (to r+1). The sum, the steps and the bytes per rank are right; every step has its two messages in flight together;
# but each link carries everything one way and nothing the other: the FAIL line names the first step whose messages
# do not go to both neighbours.
# EXPECT FAIL: bidirectional

# ANSWER: bidirectional
def bidirectional_all_reduce(x: torch.Tensor) -> torch.Tensor:
    P, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % P, (r - 1) % P
    halves = [c.tensor_split(2) for c in x.tensor_split(P)]
    first = [h[0].clone() for h in halves]
    second = [h[1].clone() for h in halves]

    def step(send: int, recv: int):
        a, b = torch.empty_like(first[recv]), torch.empty_like(second[recv])
        works = [comm.isend(first[send], right), comm.isend(second[send], right)]
        works += [comm.irecv(a, left), comm.irecv(b, left)]
        comm.wait_all(works)
        return a, b

    for s in range(P - 1):
        a, b = step((r - 1 - s) % P, (r - 2 - s) % P)
        first[(r - 2 - s) % P] += a
        second[(r - 2 - s) % P] += b
    for s in range(P - 1):
        a, b = step((r - s) % P, (r - 1 - s) % P)
        first[(r - 1 - s) % P] = a
        second[(r - 1 - s) % P] = b
    return torch.cat([torch.cat([first[c], second[c]]) for c in range(P)])
