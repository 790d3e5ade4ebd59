# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the ring expands the K/V heads to the query heads
# first and passes the expanded block on, both ways. Every number is right (each rank expands its own block
# correctly, and the blocks it receives are expanded already), but the ring carries nq/nkv = 3 times the bytes: the
# saving grouped-query attention exists for is lost on the wire.
# EXPECT FAIL: ring

# ANSWER: bidirectional_ring
def bidirectional_ring(q, k, v):
    rank, P = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % P, (rank - 1) % P
    hops_right, hops_left = P // 2, (P - 1) // 2
    group = q.shape[1] // k.shape[1]
    # the bug: nq heads travel
    going_right = going_left = torch.stack([k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)])
    state = None
    for s in range(P // 2 + 1):
        works = []
        if s < hops_right:
            from_left = torch.empty_like(going_right)
            works += [comm.irecv(from_left, left), comm.isend(going_right, right)]
        if s < hops_left:
            from_right = torch.empty_like(going_left)
            works += [comm.irecv(from_right, right), comm.isend(going_left, left)]
        for kv in [going_right] if s == 0 or s > hops_left else [going_right, going_left]:
            tile = attend(q, kv[0], kv[1])
            state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    return finish(state)
