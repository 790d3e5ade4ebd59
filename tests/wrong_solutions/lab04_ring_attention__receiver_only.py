# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: a block makes a hop only when the rank it
# reaches needs it. A rank that sees none of its keys but sits between the owner and a rank that does must pass it
# on: when the ring is not in sequence order (chunks 0, 2, 1, 3) rank 3 never gets rank 1's block, and in the
# prediction the early blocks' leftward paths through rank 0 to the last ranks are dropped.
# EXPECT FAIL: work, layer

# PREDICT: work
T, P, B, nkv, hd = 42, 8, 1, 2, 8
# set pairs_busiest, bytes_total and bytes_link: integers
pairs_busiest = max(sum(t + 1 for t in range(j, T, P)) for j in range(P))  # striped: token t sees keys 0..t
layout = [list(range(j * T // P, (j + 1) * T // P)) for j in range(P)]  # contiguous: 5, 5, 5, 6, 5, 5, 5, 6
token_bytes = 2 * B * nkv * hd * 8  # K and V of one token
link = {}  # (sender, way): bytes
for j in range(P):  # block j's path each way; it goes as far as the last rank on it that sees one of its keys
    for d, hops in ((1, P // 2), (-1, (P - 1) // 2)):
        path = [(j + d * t) % P for t in range(1, hops + 1)]
        last = (
            next((h for h, i in enumerate(path) if layout[j][0] > layout[i][-1]), len(path)) - 1
        )  # the bug: stops at the first rank that does not need it
        for h in range(last + 1):
            sender = (j + d * h) % P
            link[sender, d] = link.get((sender, d), 0) + len(layout[j]) * token_bytes
bytes_total = sum(link.values())
bytes_link = max(link.values())


# ANSWER: attention_layer
def attention_layer(x, attn, layout):
    """x: [B, n_r, H], the hidden states of this rank's tokens (global positions layout[rank], in that order);
    attn: the lab model's GQAttention (attn.q, attn.k, attn.v, attn.o, attn.cfg); layout[j]: the positions rank j
    holds. Returns the layer's output for this rank's tokens, [B, n_r, H]."""
    rank, P = dist.get_rank(), dist.get_world_size()
    B, n, _ = x.shape
    cfg = attn.cfg
    hd, group = cfg.head_size, cfg.heads // cfg.kv_heads

    def heads(t):  # [B, n, h*hd] -> [B, h, n, hd]
        return t.view(B, n, -1, hd).transpose(1, 2)

    mine = torch.tensor(layout[rank], device=x.device)  # my tokens' global positions
    q = apply_rope(heads(attn.q(x)), mine, cfg.rope_base)  # [B, nq, n, hd]
    k = apply_rope(heads(attn.k(x)), mine, cfg.rope_base)  # [B, nkv, n, hd]: rotated once, where the tokens are
    going_right = going_left = torch.stack([k, heads(attn.v(x))])  # [2, B, nkv, n, hd]: the block that travels
    right, left = (rank + 1) % P, (rank - 1) % P
    hops_right, hops_left = P // 2, (P - 1) // 2

    def sees(i, j):  # rank i's queries see a key of rank j's block: its earliest key is before i's latest query
        return min(layout[j]) <= max(layout[i])

    def useful(j, hop, d):  # block j on its hop-th hop (0: leaving its owner) way d: a rank further on needs it
        hops = hops_right if d == 1 else hops_left
        return sees((j + d * (hop + 1)) % P, j)  # the bug: only the rank it reaches, not those it would pass it on to

    state = None
    for s in range(P // 2 + 1):  # step s: I hold rank r-s's block and (while one comes from the right) rank r+s's
        works, got_left, got_right = [], None, None
        if s < hops_right and useful((rank - s - 1) % P, s, 1):  # rank r-s-1's block arrives from the left
            got_left = q.new_empty(2, B, cfg.kv_heads, len(layout[(rank - s - 1) % P]), hd)
            works.append(comm.irecv(got_left, left))
        if s < hops_right and going_right is not None and useful((rank - s) % P, s, 1):
            works.append(comm.isend(going_right, right))
        if s < hops_left and useful((rank + s + 1) % P, s, -1):  # rank r+s+1's block arrives from the right
            got_right = q.new_empty(2, B, cfg.kv_heads, len(layout[(rank + s + 1) % P]), hd)
            works.append(comm.irecv(got_right, right))
        if s < hops_left and going_left is not None and useful((rank + s) % P, s, -1):
            works.append(comm.isend(going_left, left))
        holding = {(rank - s) % P: going_right}
        if 0 < s <= hops_left:  # the opposite block (P even) came from the left only
            holding[(rank + s) % P] = going_left
        for owner, kv in holding.items():
            if kv is None:
                continue  # a block nobody on this way needed: it never came
            theirs = torch.tensor(layout[owner], device=x.device)
            mask = mine[:, None] >= theirs[None, :]  # [n, n_owner]: causal by global position, in any layout
            if mask.any():  # a block wholly in my queries' future costs nothing (it still travels on)
                k_heads = kv[0].repeat_interleave(group, dim=1)  # [B, nq, n_owner, hd]
                v_heads = kv[1].repeat_interleave(group, dim=1)
                tile = attend(q, k_heads, v_heads, mask)
                state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        going_right, going_left = got_left, got_right  # what I pass on next round (None: nothing came)
    out, _ = finish(state)  # [B, nq, n, hd]: every token saw at least itself
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
