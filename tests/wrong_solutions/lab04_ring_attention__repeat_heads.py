# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the K/V heads are expanded with Tensor.repeat, which
# tiles the whole set of heads ([0, 1, 0, 1, 0, 1]), where grouped-query attention pairs query head h with K/V head
# h // 3 ([0, 0, 0, 1, 1, 1]). The shapes fit and nothing fails loudly; the outputs are wrong, and the tile record
# shows which K/V head each query head got.
# EXPECT FAIL: ring, layer

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
            tile = attend(q, kv[0].repeat(1, group, 1, 1), kv[1].repeat(1, group, 1, 1))  # the bug
            state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    return finish(state)


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
            mask = mine[:, None] >= torch.tensor(layout[owner])[None, :]
            if mask.any():
                tile = attend(q, kv[0].repeat(1, group, 1, 1), kv[1].repeat(1, group, 1, 1), mask)  # the bug
                state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    out, _ = finish(state)
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
