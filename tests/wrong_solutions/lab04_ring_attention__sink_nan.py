# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the merge across ranks keeps the sink on rank 0 and
# takes its term exp(sink - m) out of l on the other ranks, as it should, but on every head: a head without a sink
# (sink -inf) on a row that rank does not see has m = -inf too, and exp(-inf + inf) is NaN. Heads with a sink, and
# rows every rank sees, come out right.
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
    if dist.get_rank() != 0:
        l = l - torch.exp(sink.view(-1, 1) - m)  # the bug: NaN where the sink and m are both -inf
    m_all = m.clone()
    comm.all_reduce(m_all, op=comm.ReduceOp.MAX)
    m_safe = m_all.masked_fill(torch.isneginf(m_all), 0.0)
    alpha = torch.exp(m - m_safe)
    both = torch.cat([alpha.unsqueeze(-1) * acc, (alpha * l).unsqueeze(-1)], dim=-1)
    comm.all_reduce(both)
    return both[..., :-1], m_all, both[..., -1]
