# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the reduce-scatter is the lesson's ring copied as it is (rank r starts by sending chunk r),
# so rank r finishes chunk r+1, not chunk r. Every message is a right partial sum of the wrong chunk: the FAIL line
# names the chunk expected and the one that came.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(chunks: list[torch.Tensor]) -> None:
    P, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % P, (r - 1) % P
    for s in range(P - 1):
        send, recv = (r - s) % P, (r - s - 1) % P
        incoming = torch.empty_like(chunks[recv])
        comm.wait_all([comm.isend(chunks[send], right), comm.irecv(incoming, left)])
        chunks[recv] += incoming
