# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the ring posts its transfers with isend/irecv but
# waits for them at once, before computing the step's tiles. The numbers are right and nothing deadlocks, but no
# transfer is in flight while a tile computes: the communication is serial, the ring's point is lost.
# EXPECT FAIL: ring

# ANSWER: bidirectional_ring
def bidirectional_ring(q, k, v):
    rank, P = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % P, (rank - 1) % P
    hops_right, hops_left = P // 2, (P - 1) // 2
    group = q.shape[1] // k.shape[1]
    going_right = going_left = torch.stack([k, v])
    state = None
    for s in range(P // 2 + 1):
        holding = [going_right] if s == 0 or s > hops_left else [going_right, going_left]
        works = []
        if s < hops_right:
            from_left = torch.empty_like(going_right)
            works += [comm.irecv(from_left, left), comm.isend(going_right, right)]
        if s < hops_left:
            from_right = torch.empty_like(going_left)
            works += [comm.irecv(from_right, right), comm.isend(going_left, left)]
        comm.wait_all(works)  # the bug: before the tiles
        for kv in holding:
            tile = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1))
            state = tile if state is None else merge(state, tile)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    return finish(state)
