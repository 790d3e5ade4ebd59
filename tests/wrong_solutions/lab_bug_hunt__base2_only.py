# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 6 half fixed. The
# lse is turned from base 2 into the natural log the library's backward takes (times ln 2), so the gradients are
# exact with one query head per K/V head; but with grouped heads the packed rows (token t of head j at row t g + j)
# are still read back as if they were in (head, token) order: each head's lse lands on other heads' and tokens'
# queries, and the gradients of (6, 2) stay wrong.
# EXPECT FAIL: ring_gqa

# ANSWER: ring_forward
def ring_forward(q, k, v):
    P, r = comm.group_size(), comm.group_rank()
    B, nq, c, hd = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    qp = q.view(B, nkv, g, c, hd).transpose(2, 3).reshape(B, nkv, c * g, hd)
    token = torch.arange(c * g, device=q.device) // g
    future = torch.arange(c, device=q.device)[None, :] > token[:, None]
    scale = math.log2(math.e) / math.sqrt(hd)
    m = torch.full((B, nkv, c * g), -math.inf, dtype=q.dtype, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(qp)
    kv = torch.stack([k, v])
    for step in range(P):
        src = (r - step) % P
        if step < P - 1:
            incoming, works = pass_on(kv)
        if src <= r:
            s = qp @ kv[0].transpose(-2, -1) * scale
            if src == r:
                s = s.masked_fill(future, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            correction = torch.exp2(m - m_new)
            p = torch.exp2(s - m_new.unsqueeze(-1))
            l = l * correction + p.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + p @ kv[1]
            m = m_new
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    out = (acc / l.unsqueeze(-1)).view(B, nkv, c, g, hd).transpose(2, 3).reshape(B, nq, c, hd)
    lse = ((m + torch.log2(l)) * math.log(2)).view(B, nq, c)
    return out, lse
