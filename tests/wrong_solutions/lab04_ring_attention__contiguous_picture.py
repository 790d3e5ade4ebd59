# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb: the contiguous picture applied everywhere. The layer decides
# causality by rank numbers (an earlier rank's block whole, the own block masked on its diagonal, a later rank's
# block skipped), right only when rank r holds the r-th stretch of the sequence; under the striped layout every
# block holds early and late tokens. The prediction takes the last rank for the busiest, as it is when contiguous.
# EXPECT FAIL: work, layer

# PREDICT: work
T, P, B, nkv, hd = 42, 8, 1, 2, 8
tokens = [len(range(j, T, P)) for j in range(P)]
pairs_busiest = sum(t + 1 for t in range(P - 1, T, P))  # the bug: the last rank
token_bytes = 2 * B * nkv * hd * 8
to_right = [sum(tokens[(r - s) % P] for s in range(P // 2)) for r in range(P)]
to_left = [sum(tokens[(r + s) % P] for s in range((P - 1) // 2)) for r in range(P)]
bytes_total = (sum(to_right) + sum(to_left)) * token_bytes
bytes_link = max(to_right + to_left) * token_bytes


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
            if owner <= rank:  # the bug: a later rank's block is in my future, my own block is the diagonal
                mask = torch.ones(n, kv.shape[-2], dtype=torch.bool).tril() if owner == rank else None
                tile = attend(q, kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1), mask)
                state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    out, _ = finish(state)
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
