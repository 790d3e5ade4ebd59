# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 6 rewritten on the
# library's tile code, pasted instead of imported (so no call into parlab's sequence code is seen): each visible
# block attended with a copy of attend_tile and merged with a copy of merge_partials, the K/V heads repeated for
# their query heads after receiving the block. The traffic stays that of nkv heads and every number is right, but
# every visible block is copied once per query head on the rank: the memory and memory traffic grouped-query
# attention exists to save, and what the user's packing avoids.
# EXPECT FAIL: ring_gqa

# ANSWER: ring_forward
def tile(q, k, v, diagonal):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if diagonal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b, lse


def ring_forward(q, k, v):
    P, r = comm.group_size(), comm.group_rank()
    group = q.shape[1] // k.shape[1]
    out = lse = None
    kv = torch.stack([k, v])
    for step in range(P):
        src = (r - step) % P
        if step < P - 1:
            incoming, works = pass_on(kv)
        if src <= r:
            k_s, v_s = (t.repeat_interleave(group, dim=1) for t in kv)
            o, s = tile(q, k_s, v_s, src == r)
            out, lse = (o, s) if out is None else merge(out, lse, o, s)
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    return out, lse
