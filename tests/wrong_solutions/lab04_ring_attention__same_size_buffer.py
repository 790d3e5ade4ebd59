# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the receive buffers are shaped like the rank's own
# block (torch.empty_like), as in part 2, where every block has n tokens. With 18 tokens striped over 4 ranks the
# blocks hold 5, 5, 4 and 4 tokens: rank 2 posts a 4-token buffer for rank 1's 5-token block, and gloo aborts the
# rank ("Received data size doesn't match expected size"). The even layouts pass.
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
        if s < hops_right:
            from_left = torch.empty_like(going_right)  # the bug: the arriving block may be larger or smaller
            works += [comm.irecv(from_left, left), comm.isend(going_right, right)]
        if s < hops_left:
            from_right = torch.empty_like(going_left)
            works += [comm.irecv(from_right, right), comm.isend(going_left, left)]
        holding = {(rank - s) % P: going_right}
        if 0 < s <= hops_left:
            holding[(rank + s) % P] = going_left
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
