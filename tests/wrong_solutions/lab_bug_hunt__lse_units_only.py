# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 6 half
# fixed. The lse is in one unit now (the running max of the raw q.k times the scale, beside the log2 of the sum,
# all times ln 2), so the gradients are exact with one query head per K/V head; but with grouped heads the packed
# rows (token t of head j at row t g + j) are still read back as if they were in (head, token) order: each head's
# lse lands on other heads' and tokens' queries, and the gradients of (6, 2) stay wrong.
# EXPECT FAIL: ring_gqa

# ANSWER: ring_forward
def ring_forward(q, k, v):
    P, r = comm.group_size(), comm.group_rank()
    B, nq, c, hd = q.shape
    nkv = k.shape[1]
    g = nq // nkv  # query heads per K/V head
    # The g query heads of each K/V head as the rows of one product: row t g + j is token t of head j of the group.
    qp = q.view(B, nkv, g, c, hd).transpose(2, 3).reshape(B, nkv, c * g, hd)  # [B, nkv, c g, hd]
    token = torch.arange(c * g, device=q.device) // g  # each row's token
    future = torch.arange(c, device=q.device)[None, :] > token[:, None]  # [c g, c]: the keys a row may not see
    scale = math.log2(math.e) / math.sqrt(hd)  # the softmax in base 2, as FlashAttention computes it: exp2 is cheap
    m = torch.full((B, nkv, c * g), -math.inf, dtype=q.dtype, device=q.device)  # running max of the raw q.k
    l = torch.zeros_like(m)  # running sum of 2^((q.k - m) scale)
    acc = torch.zeros_like(qp)  # running sum of 2^((q.k - m) scale) v: [B, nkv, c g, hd]
    kv = torch.stack([k, v])  # the block that travels, K/V heads only: [2, B, nkv, c, hd]
    for step in range(P):
        src = (r - step) % P  # whose K/V this rank holds now
        if step < P - 1:
            incoming, works = pass_on(kv)  # pass it on while computing with it
        if src <= r:  # causal: the queries of rank r see the blocks of ranks 0..r
            s = qp @ kv[0].transpose(-2, -1)  # [B, nkv, c g, c]: raw q.k, the scale applied in the exponent
            if src == r:
                s = s.masked_fill(future, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            correction = torch.exp2((m - m_new) * scale)
            p = torch.exp2((s - m_new.unsqueeze(-1)) * scale)
            l = l * correction + p.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + p @ kv[1]
            m = m_new
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    out = (acc / l.unsqueeze(-1)).view(B, nkv, c, g, hd).transpose(2, 3).reshape(B, nq, c, hd)  # heads back
    lse = ((m * scale + torch.log2(l)) * math.log(2)).view(B, nq, c)
    return out, lse
