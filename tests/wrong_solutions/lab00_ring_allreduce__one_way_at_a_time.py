# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the two rings take turns: each step exchanges the clockwise halves and waits, then the
# counter-clockwise ones. Every message and every sum is right, but a link never carries data both ways at once,
# so the steps take twice as long as they should: the check sees, in the trace, one direction waited for before the
# other was issued.
# EXPECT FAIL: bidirectional

# ANSWER: bidirectional
def bidirectional_all_reduce(x: torch.Tensor) -> torch.Tensor:
    P, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % P, (r - 1) % P
    halves = [c.tensor_split(2) for c in x.tensor_split(P)]
    cw = [h[0].clone() for h in halves]
    ccw = [h[1].clone() for h in halves]

    def exchange(pieces, send, recv, to, frm):
        incoming = torch.empty_like(pieces[recv])
        comm.wait_all([comm.isend(pieces[send], to), comm.irecv(incoming, frm)])
        return incoming

    for s in range(P - 1):
        cw[(r - 2 - s) % P] += exchange(cw, (r - 1 - s) % P, (r - 2 - s) % P, right, left)
        ccw[(r + 2 + s) % P] += exchange(ccw, (r + 1 + s) % P, (r + 2 + s) % P, left, right)
    for s in range(P - 1):
        cw[(r - 1 - s) % P] = exchange(cw, (r - s) % P, (r - 1 - s) % P, right, left)
        ccw[(r + 1 + s) % P] = exchange(ccw, (r + s) % P, (r + 1 + s) % P, left, right)
    return torch.cat([torch.cat([cw[c], ccw[c]]) for c in range(P)])
