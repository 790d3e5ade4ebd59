# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb: the library's ring piece, pasted in by import. The rightward
# half of the ring passes its block on with parlab.schemes.sequence.ring_attention's _pass_on (which sends to rank
# r+1 and receives from r-1); the leftward half is the student's own. The numbers, the traffic, the tiles and the
# overlap are all right, but the part asks for the student's own ring, and the check names the library call.
# EXPECT FAIL: ring

# ANSWER: bidirectional_ring
from parlab.schemes.sequence.ring_attention import _pass_on


def bidirectional_ring(q, k, v):
    rank, P = dist.get_rank(), dist.get_world_size()
    hops_right, hops_left = P // 2, (P - 1) // 2
    group = q.shape[1] // k.shape[1]
    going_right = going_left = torch.stack([k, v])
    state = None
    for s in range(P // 2 + 1):
        works = []
        if s < hops_right:
            from_left, works = _pass_on(going_right, None, "")
        if s < hops_left:
            from_right = torch.empty_like(going_left)
            works += [comm.irecv(from_right, (rank + 1) % P), comm.isend(going_left, (rank - 1) % P)]
        for kv in [going_right] if s == 0 or s > hops_left else [going_right, going_left]:
            tile = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1))
            state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    return finish(state)
