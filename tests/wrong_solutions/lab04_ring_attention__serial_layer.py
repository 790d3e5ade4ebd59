# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb (issue 40: the causal part once accepted it). The bug: the layer
# waits for each step's transfers as soon as it has posted them, before computing the tile. The outputs, the tiles
# and the traffic are right and nothing deadlocks, but no transfer is in flight while a tile computes.
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
    kv = torch.stack([k, heads(attn.v(x))])
    out = lse = None
    for step in range(P):
        src = (rank - step) % P
        held = kv
        if step < P - 1:  # the bug: the next block is fetched before this one is used
            incoming = kv.new_empty(2, B, cfg.kv_heads, len(layout[(src - 1) % P]), hd)
            comm.wait_all([comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)])
            kv = incoming
        mask = mine[:, None] >= torch.tensor(layout[src])[None, :]
        if mask.any():
            o, block_lse = attend(
                q, held[0].repeat_interleave(group, dim=1), held[1].repeat_interleave(group, dim=1), mask
            )
            out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
