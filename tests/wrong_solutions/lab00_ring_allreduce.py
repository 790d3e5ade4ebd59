# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the counter-clockwise ring reuses the clockwise ring's chunk indices (send chunk r-1-s) and
# only turns the direction round. Its halves then start one rank too far and finish on rank c+2 instead of c; the
# all-gather passes on partial sums. The clockwise ring, every neighbour, the steps and the bytes are right: the FAIL
# line names the first rank whose sum is wrong, the element, what it should be and what came.
# EXPECT FAIL: bidirectional

# ANSWER: bidirectional
def bidirectional_all_reduce(x: torch.Tensor) -> torch.Tensor:
    P, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % P, (r - 1) % P
    halves = [c.tensor_split(2) for c in x.tensor_split(P)]
    cw = [h[0].clone() for h in halves]
    ccw = [h[1].clone() for h in halves]

    def step(send_cw, recv_cw, send_ccw, recv_ccw):
        a, b = torch.empty_like(cw[recv_cw]), torch.empty_like(ccw[recv_ccw])
        works = [comm.isend(cw[send_cw], right), comm.irecv(a, left)]
        works += [comm.isend(ccw[send_ccw], left), comm.irecv(b, right)]
        comm.wait_all(works)
        return a, b

    for s in range(P - 1):
        a, b = step((r - 1 - s) % P, (r - 2 - s) % P, (r - 1 - s) % P, (r - s) % P)
        cw[(r - 2 - s) % P] += a
        ccw[(r - s) % P] += b
    for s in range(P - 1):
        a, b = step((r - s) % P, (r - 1 - s) % P, (r - s) % P, (r + 1 - s) % P)
        cw[(r - 1 - s) % P] = a
        ccw[(r + 1 - s) % P] = b
    return torch.cat([torch.cat([cw[c], ccw[c]]) for c in range(P)])
