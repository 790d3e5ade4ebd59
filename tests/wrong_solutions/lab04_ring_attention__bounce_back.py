# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb: a wrong direction. The ring names its blocks by where they came
# from and sends each back that way: the block that came from the left (travelling rightward) is passed on to the
# left, back to the rank that just sent it. Round 0 is right (both blocks are the rank's own); from then on blocks
# bounce between neighbours: a rank gets its own block back, counts a neighbour's twice, and never sees the far ones.
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
        works = []
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
            going_left = from_left  # the bug: what came from the left goes back left
        if s < hops_left:
            going_right = from_right  # and what came from the right back right
    return finish(state)
