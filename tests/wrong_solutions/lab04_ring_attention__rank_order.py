# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb: the contiguous picture applied everywhere. The causal attention
# decides the future by rank numbers (a block of a later rank is skipped, the own block is masked on its diagonal),
# right only when rank r holds chunk r; and the prediction gives zigzag's tiles the size of contiguous ones.
# EXPECT FAIL: work, causal

# ANSWER: work
T, P = 32, 4
scores_contiguous = P * (T // P) ** 2
scores_zigzag = (2 * P + 1) * (T // P) ** 2


# ANSWER: causal_attention
def causal_attention(q, k, v, layout):
    rank, P = dist.get_rank(), dist.get_world_size()
    n = len(layout[rank])
    qs = q.chunk(n, dim=-2)
    outs, lses = [None] * n, [None] * n
    kv = torch.stack([k, v])
    for step in range(P):
        src = (rank - step) % P
        if step < P - 1:
            incoming = torch.empty_like(kv)
            works = [comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)]
        if src <= rank:  # a later rank's block is in my future
            ks, vs = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
            for i in range(n):
                for j in range(n):
                    if src == rank and j > i:
                        continue
                    o, block_lse = attend(qs[i], ks[j], vs[j], diagonal=src == rank and i == j)
                    if outs[i] is None:
                        outs[i], lses[i] = o, block_lse
                    else:
                        outs[i], lses[i] = merge(outs[i], lses[i], o, block_lse)
        if step < P - 1:
            comm.wait_all(works)
            kv = incoming
    return torch.cat(outs, dim=-2)
