# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb (issue 37: its hang was once blamed on a blocking send). The bug:
# the ring step keeps its handles in a list that outlives the step, and waits for the whole list at the end of
# every step: from the second step on it waits again for the first step's handles. gloo's wait() on a finished
# send or receive never returns: the ranks hang, and the launch stops them within seconds, naming the second wait.
# EXPECT FAIL: ring

# ANSWER: ring_step
handles = []  # the bug: every step's handles, never cleared


def ring_step(q, k, v, out, lse):
    rank, P = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    incoming = torch.empty_like(kv)
    handles.extend([comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)])
    group = q.shape[1] // k.shape[1]
    o, block_lse = attend(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
    comm.wait_all(handles)
    return out, lse, incoming[0], incoming[1]
