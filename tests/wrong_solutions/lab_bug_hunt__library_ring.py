# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 6 rewritten on the
# library's tiles: each visible block attended with parlab's attend_tile and merged with its merge_partials (the
# K/V heads repeated after receiving, so the traffic stays that of nkv heads). Every number is right, but the fix
# calls the library's ring attention code: the check sees the calls and names them.
# EXPECT FAIL: ring_gqa

# ANSWER: ring_forward
from parlab.schemes.sequence.ring_attention import attend_tile, merge_partials


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
            o, s = attend_tile(q, k_s, v_s, "diagonal" if src == r else "full")
            out, lse = (o, s) if out is None else merge_partials(out, lse, o, s)
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    return out, lse
