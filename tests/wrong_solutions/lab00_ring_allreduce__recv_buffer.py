# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the receive buffer is sized like the chunk this rank sends, not like the one that arrives.
# With 1000 elements on 4 ranks every chunk has 250 and nothing shows; with 10 on 3 ranks (chunks of 4, 3, 3) a
# rank receives a chunk of one size into a buffer of another and the check's run fails on its ranks.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(chunks: list[torch.Tensor], ring: list[int]) -> None:
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]
    for s in range(P - 1):
        send, recv = ring[(m - 1 - s) % P], ring[(m - 2 - s) % P]
        incoming = torch.empty_like(chunks[send])
        comm.wait_all([comm.isend(chunks[send], right), comm.irecv(incoming, left)])
        chunks[recv] += incoming
