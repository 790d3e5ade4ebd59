# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb (found by a student: it once scored full marks). The bug: the
# ring carries the keys unrotated, and each rank rotates a block when it arrives, by its owner's positions. The
# numbers, the tiles and their masks are right, but every key is rotated once by every rank that uses it (P times
# instead of once), and the K on the wire is not the rotated one the part asks for.
# EXPECT FAIL: layer

# ANSWER: attention_layer
def attention_layer(x, attn, layout):
    rank, P = dist.get_rank(), dist.get_world_size()
    B, n, _ = x.shape
    cfg = attn.cfg
    hd, group = cfg.head_size, cfg.heads // cfg.kv_heads
    heads = lambda t: t.view(B, n, -1, hd).transpose(1, 2)
    mine = torch.tensor(layout[rank])
    q = apply_rope(heads(attn.q(x)), mine, cfg.rope_base)
    going_right = going_left = torch.stack([heads(attn.k(x)), heads(attn.v(x))])  # the bug: K as it comes out
    right, left = (rank + 1) % P, (rank - 1) % P
    hops_right, hops_left = P // 2, (P - 1) // 2
    state = None
    for s in range(P // 2 + 1):
        works = []
        if s < hops_right:
            from_left = going_right.new_empty(2, B, cfg.kv_heads, len(layout[(rank - s - 1) % P]), hd)
            works += [comm.irecv(from_left, left), comm.isend(going_right, right)]
        if s < hops_left:
            from_right = going_left.new_empty(2, B, cfg.kv_heads, len(layout[(rank + s + 1) % P]), hd)
            works += [comm.irecv(from_right, right), comm.isend(going_left, left)]
        holding = {(rank - s) % P: going_right}
        if 0 < s <= hops_left:
            holding[(rank + s) % P] = going_left
        for owner, kv in holding.items():
            theirs = torch.tensor(layout[owner])
            mask = mine[:, None] >= theirs[None, :]
            if mask.any():
                k = apply_rope(kv[0], theirs, cfg.rope_base)  # rotated here, by the owner's positions
                tile = attend(q, k.repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1), mask)
                state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    out, _ = finish(state)
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
