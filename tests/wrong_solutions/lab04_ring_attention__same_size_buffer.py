# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the receive buffer is shaped like the rank's own block
# (torch.empty_like), as in part 2, where every block has T/P tokens. With 18 tokens striped over 4 ranks the blocks
# hold 5, 5, 4 and 4 tokens: rank 2 posts a 4-token buffer for rank 1's 5-token block, and gloo aborts the rank
# ("Received data size doesn't match expected size"). The even layouts pass.
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
        if step < P - 1:
            incoming = torch.empty_like(kv)  # the bug: the arriving block may be larger or smaller
            works = [comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)]
        mask = mine[:, None] >= torch.tensor(layout[src])[None, :]
        if mask.any():
            o, block_lse = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1), mask)
            out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
