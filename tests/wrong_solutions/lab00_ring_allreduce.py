# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: the all-gather adds the arriving chunk instead of replacing this rank's copy, so every
# chunk but the rank's own finished one ends up as the full sum plus whatever the rank held before (NaN in the
# all_gather check, a partial sum in the whole ring).
# EXPECT FAIL: all_gather, ring_all_reduce

# ANSWER: all_gather
def all_gather_phase(chunks: list[torch.Tensor]) -> None:
    P, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % P, (r - 1) % P
    for s in range(P - 1):
        send, recv = (r - s) % P, (r - 1 - s) % P
        incoming = torch.empty_like(chunks[recv])
        comm.wait_all([comm.isend(chunks[send], right), comm.irecv(incoming, left)])
        chunks[recv] += incoming
