# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: every block travels as far both ways, P // 2 hops.
# With an odd P that is right; with an even P the block opposite a rank (rank r + P/2) reaches it from both sides at
# the last step, and the rank attends to both copies: that block counts twice in the softmax. The prediction makes
# the same mistake: the opposite block sent both ways.
# EXPECT FAIL: ring, work

# ANSWER: bidirectional_ring
def bidirectional_ring(q, k, v):
    rank, P = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % P, (rank - 1) % P
    hops = P // 2  # the bug: as many hops leftward as rightward
    group = q.shape[1] // k.shape[1]
    going_right = going_left = torch.stack([k, v])
    state = None
    for s in range(hops + 1):
        works = []
        if s < hops:
            from_left, from_right = torch.empty_like(going_right), torch.empty_like(going_left)
            works += [comm.irecv(from_left, left), comm.isend(going_right, right)]
            works += [comm.irecv(from_right, right), comm.isend(going_left, left)]
        for kv in [going_right] if s == 0 else [going_right, going_left]:
            tile = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1))
            state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops:
            going_right, going_left = from_left, from_right
    return finish(state)


# PREDICT: work
T, P, B, nkv, hd = 42, 8, 1, 2, 8
# set pairs_busiest, bytes_total and bytes_link: integers
pairs_busiest = max(sum(t + 1 for t in range(j, T, P)) for j in range(P))  # striped: token t sees keys 0..t
layout = [list(range(j * T // P, (j + 1) * T // P)) for j in range(P)]  # contiguous: 5, 5, 5, 6, 5, 5, 5, 6
token_bytes = 2 * B * nkv * hd * 8  # K and V of one token
link = {}  # (sender, way): bytes
for j in range(P):  # block j's path each way; it goes as far as the last rank on it that sees one of its keys
    for d, hops in ((1, P // 2), (-1, P // 2)):  # the bug: the opposite block both ways
        path = [(j + d * t) % P for t in range(1, hops + 1)]
        last = max((h for h, i in enumerate(path) if layout[j][0] <= layout[i][-1]), default=-1)
        for h in range(last + 1):
            sender = (j + d * h) % P
            link[sender, d] = link.get((sender, d), 0) + len(layout[j]) * token_bytes
bytes_total = sum(link.values())
bytes_link = max(link.values())
