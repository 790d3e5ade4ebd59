# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the layer sends every block the whole of part 2's
# ring both ways, as without a mask: right on the striped layouts (every rank needs every block), but on the contiguous
# ones a block goes on to ranks that see none of its keys and pass it to nobody who does.
# EXPECT FAIL: layer

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
    state = None
    for s in range(P // 2 + 1):  # step s: I hold rank r-s's block and (while one comes from the right) rank r+s's
        works = []
        if s < hops_right:  # rank r-s-1's block arrives from the left: its size, not mine
            from_left = going_right.new_empty(2, B, cfg.kv_heads, len(layout[(rank - s - 1) % P]), hd)
            works += [comm.irecv(from_left, left), comm.isend(going_right, right)]
        if s < hops_left:  # rank r+s+1's block arrives from the right
            from_right = going_left.new_empty(2, B, cfg.kv_heads, len(layout[(rank + s + 1) % P]), hd)
            works += [comm.irecv(from_right, right), comm.isend(going_left, left)]
        holding = {(rank - s) % P: going_right}
        if 0 < s <= hops_left:  # the opposite block (P even) came from the left only
            holding[(rank + s) % P] = going_left
        for owner, kv in holding.items():
            theirs = torch.tensor(layout[owner], device=x.device)
            mask = mine[:, None] >= theirs[None, :]  # [n, n_owner]: causal by global position, in any layout
            if mask.any():  # a block wholly in my queries' future costs nothing (it still travels on)
                k_heads = kv[0].repeat_interleave(group, dim=1)  # [B, nq, n_owner, hd]
                v_heads = kv[1].repeat_interleave(group, dim=1)
                tile = attend(q, k_heads, v_heads, mask)
                state = tile if state is None else merge(state, tile)
        comm.wait_all(works)
        if s < hops_right:
            going_right = from_left
        if s < hops_left:
            going_left = from_right
    out, _ = finish(state)  # [B, nq, n, hd]: every token saw at least itself
    return attn.o(out.transpose(1, 2).reshape(B, n, -1))
