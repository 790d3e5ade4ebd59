# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the K/V heads are expanded with Tensor.repeat, which
# tiles the whole set of heads ([0, 1, 0, 1, 0, 1]), where grouped-query attention pairs query head h with K/V head
# h // 3 ([0, 0, 0, 1, 1, 1], repeat_interleave). The shapes fit and nothing fails loudly; the outputs are wrong, and
# the tile record shows which K/V head each query head got.
# EXPECT FAIL: ring, layer

# ANSWER: ring_step
def ring_step(q, k, v, out, lse):
    rank, P = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    incoming = torch.empty_like(kv)
    works = [comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)]
    group = q.shape[1] // k.shape[1]
    o, block_lse = attend(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1))
    out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
    comm.wait_all(works)
    return out, lse, incoming[0], incoming[1]


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
    kv = torch.stack([k, heads(attn.v(x))])
    out = lse = None
    for step in range(P):
        src = (rank - step) % P
        if step < P - 1:
            incoming = kv.new_empty(2, B, cfg.kv_heads, len(layout[(src - 1) % P]), hd)
            works = [comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)]
        mask = mine[:, None] >= torch.tensor(layout[src])[None, :]
        if mask.any():
            o, block_lse = attend(q, kv[0].repeat(1, group, 1, 1), kv[1].repeat(1, group, 1, 1), mask)
            out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
