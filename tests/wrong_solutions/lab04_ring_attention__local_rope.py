# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: each rank rotates its q and k by the positions of its
# tokens in its own block (0, 1, 2, ...), as a layer on one device would, instead of their global positions in the
# sequence. Scores depend on the difference of two tokens' positions: with local positions, two tokens on different
# ranks get the wrong distance. The ring, the masks and the traffic are right.
# EXPECT FAIL: layer

# ANSWER: attention_layer
def attention_layer(x, attn, layout):
    rank, P = dist.get_rank(), dist.get_world_size()
    B, n, _ = x.shape
    cfg = attn.cfg
    hd, group = cfg.head_size, cfg.heads // cfg.kv_heads
    heads = lambda t: t.view(B, n, -1, hd).transpose(1, 2)
    mine = torch.tensor(layout[rank])
    local = torch.arange(n)  # the bug: positions within the block
    q = apply_rope(heads(attn.q(x)), local, cfg.rope_base)
    k = apply_rope(heads(attn.k(x)), local, cfg.rope_base)
    kv = torch.stack([k, heads(attn.v(x))])
    out = lse = None
    for step in range(P):
        src = (rank - step) % P
        if step < P - 1:
            incoming = kv.new_empty(2, B, cfg.kv_heads, len(layout[(src - 1) % P]), hd)
            works = [comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)]
        mask = mine[:, None] >= torch.tensor(layout[src])[None, :]
        if mask.any():
            o, block_lse = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1), mask)
            out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
