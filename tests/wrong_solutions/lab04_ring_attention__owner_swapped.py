# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb: a wrong direction. The layer takes the block that arrives from
# the left (rank r-1) for rank r+s's and the one from the right for rank r-s's: blocks travelling rightward come
# from ranks below, not above. The receive buffers get the other block's size and the masks the other block's
# positions: with 16 striped tokens the masks are wrong (and so is the output), with 18 the sizes differ and gloo
# aborts a rank. Part 2 has no mask and blocks of one size, so there the same confusion does no harm.
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
    k = apply_rope(heads(attn.k(x)), mine, cfg.rope_base)
    going_right = going_left = torch.stack([k, heads(attn.v(x))])
    right, left = (rank + 1) % P, (rank - 1) % P
    hops_right, hops_left = P // 2, (P - 1) // 2
    state = None
    for s in range(P // 2 + 1):
        works = []
        if s < hops_right:  # the bug: the owners of the two arriving blocks swapped
            from_left = going_right.new_empty(2, B, cfg.kv_heads, len(layout[(rank + s + 1) % P]), hd)
            works += [comm.irecv(from_left, left), comm.isend(going_right, right)]
        if s < hops_left:
            from_right = going_left.new_empty(2, B, cfg.kv_heads, len(layout[(rank - s - 1) % P]), hd)
            works += [comm.irecv(from_right, right), comm.isend(going_left, left)]
        holding = {(rank + s) % P: going_right}  # the bug
        if 0 < s <= hops_left:
            holding[(rank - s) % P] = going_left
        for owner, kv in holding.items():
            mask = mine[:, None] >= torch.tensor(layout[owner])[None, :]
            if mask.any():
                tile = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1), mask)
                state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    out, _ = finish(state)
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
