# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb (issue 37: its hang was once blamed on a blocking send). The bug:
# the ring keeps its handles in one list for all rounds and waits for the whole list at the end of every round:
# from the second round on it waits again for the first round's handles. gloo's wait() on a finished send or
# receive never returns: the ranks hang, and the launch stops them within seconds, naming the second wait.
# EXPECT FAIL: ring

# ANSWER: bidirectional_ring
def bidirectional_ring(q, k, v):
    rank, P = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % P, (rank - 1) % P
    hops_right, hops_left = P // 2, (P - 1) // 2
    group = q.shape[1] // k.shape[1]
    going_right = going_left = torch.stack([k, v])
    state = None
    works = []  # the bug: every round's handles, never cleared
    for s in range(P // 2 + 1):
        if s < hops_right:
            from_left = torch.empty_like(going_right)
            works += [comm.irecv(from_left, left), comm.isend(going_right, right)]
        if s < hops_left:
            from_right = torch.empty_like(going_left)
            works += [comm.irecv(from_right, right), comm.isend(going_left, left)]
        for kv in [going_right] if s == 0 or s > hops_left else [going_right, going_left]:
            tile = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1))
            state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    return finish(state)
