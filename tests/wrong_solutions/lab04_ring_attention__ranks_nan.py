# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the merge across ranks measures every rank's terms
# against the max over all ranks, as it should, but forgets the rows no rank sees: there that max is -inf, and
# exp(m - max) = exp(-inf + inf) is NaN. The pairwise merge guards it; the all-reduce version does not. (It counts
# the sink once, rightly.) Where a head has a sink, its max is finite on every row and all passes; on the head
# without a sink, the rows no rank sees come back NaN.
# EXPECT FAIL: merge

# ANSWER: merge
def merge(a, b):
    acc_a, m_a, l_a = a
    acc_b, m_b, l_b = b
    m = torch.maximum(m_a, m_b)
    m_safe = m.masked_fill(torch.isneginf(m), 0.0)
    alpha, beta = torch.exp(m_a - m_safe), torch.exp(m_b - m_safe)
    return alpha.unsqueeze(-1) * acc_a + beta.unsqueeze(-1) * acc_b, m, alpha * l_a + beta * l_b


def finish(state):
    acc, m, l = state
    return acc / l.masked_fill(l == 0, 1.0).unsqueeze(-1), m + torch.log(l)


def merge_across_ranks(state, sink):
    acc, m, l = state
    if dist.get_rank() != 0:  # the sink once: rank 0's
        l = l - torch.where(torch.isneginf(sink).view(-1, 1), 0.0, torch.exp(sink.view(-1, 1) - m))
    m_all = m.clone()
    comm.all_reduce(m_all, op=comm.ReduceOp.MAX)
    alpha = torch.exp(m - m_all)  # the bug: NaN where m_all is -inf
    both = torch.cat([alpha.unsqueeze(-1) * acc, (alpha * l).unsqueeze(-1)], dim=-1)
    comm.all_reduce(both)
    return both[..., :-1], m_all, both[..., -1]
