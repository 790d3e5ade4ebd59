# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the lesson's loop moved onto the ring's places as it is: the rank at place m first sends the
# chunk of the rank at place m, so every chunk finishes one place further on, on the next rank of the ring (chunk r
# ends on the rank after r). Every message is a right partial sum over the right ranks; the FAIL line says which
# rank's chunk r is incomplete and whose sum it holds.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(chunks: list[torch.Tensor], ring: list[int]) -> None:
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]
    for s in range(P - 1):
        send, recv = ring[(m - s) % P], ring[(m - s - 1) % P]
        incoming = torch.empty_like(chunks[recv])
        comm.wait_all([comm.isend(chunks[send], right), comm.irecv(incoming, left)])
        chunks[recv] += incoming
