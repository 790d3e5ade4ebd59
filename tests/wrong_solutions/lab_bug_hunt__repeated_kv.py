# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 6 "fixed" by giving
# up the packing: each K/V head is repeated for its query heads before the ring, and the forward runs as if every
# query head had its own K/V head. Every number is right, but every K/V block that travels now holds nq heads
# instead of nkv: three times the bytes here (nq / nkv in general), which is what grouped-query attention exists to
# avoid.
# EXPECT FAIL: ring_gqa

# ANSWER: ring_forward
def ring_forward(q, k, v):
    P, r = comm.group_size(), comm.group_rank()
    B, nq, c, hd = q.shape
    group = nq // k.shape[1]
    m = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
    l = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    acc = torch.zeros_like(q)
    kv = torch.stack([k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)])
    future = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    for step in range(P):
        src = (r - step) % P
        if step < P - 1:
            incoming, works = pass_on(kv)
        if src <= r:
            s = q @ kv[0].transpose(-2, -1) / math.sqrt(hd)
            if src == r:
                s = s.masked_fill(future, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            scale = torch.exp(m - m_new)
            p = torch.exp(s - m_new.unsqueeze(-1))
            l = l * scale + p.sum(dim=-1)
            acc = acc * scale.unsqueeze(-1) + p @ kv[1]
            m = m_new
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    return acc / l.unsqueeze(-1), m + torch.log(l)
