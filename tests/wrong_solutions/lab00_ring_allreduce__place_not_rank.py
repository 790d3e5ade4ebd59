# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the ring is followed by places, and so are the chunks: the rank at place m finishes chunk m,
# not the chunk of its own rank number. On a ring in rank order that is the same thing; on [0, 2, 3, 1] rank 2 (at
# place 1) finishes chunk 1. The messages are right partial sums over the right ranks; chunk r is not complete on
# rank r.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(chunks: list[torch.Tensor], ring: list[int]) -> None:
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]
    for s in range(P - 1):
        send, recv = (m - 1 - s) % P, (m - 2 - s) % P
        incoming = torch.empty_like(chunks[recv])
        comm.wait_all([comm.isend(chunks[send], right), comm.irecv(incoming, left)])
        chunks[recv] += incoming
