# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb: the contiguous picture applied everywhere. The layer decides
# causality by rank numbers (an earlier rank's block whole, the own block masked on its diagonal, a later rank's
# block skipped), right only when rank r holds the r-th stretch of the sequence; under the striped layout every
# block holds early and late tokens. The prediction counts the striped rank's work the same way.
# EXPECT FAIL: work, layer

# ANSWER: work
T, P, B, nq, nkv, hd = 40, 4, 1, 6, 2, 8
c = T // P
pairs_contiguous = (P - 1) * c * c + c * (c + 1) // 2
pairs_striped = (P - 1) * c * c + c * (c + 1) // 2  # the bug: the last rank's blocks taken as before/own/after
bytes_sent = (P - 1) * 2 * B * nkv * c * hd * 8


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
        if src <= rank:  # the bug: a later rank's block is in my future, my own block is the diagonal
            n_src = kv.shape[-2]
            mask = torch.ones(n, n_src, dtype=torch.bool).tril() if src == rank else None
            o, block_lse = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1), mask)
            out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
