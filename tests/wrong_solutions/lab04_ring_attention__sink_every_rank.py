# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the merge across ranks is the plain one (the common
# max by a MAX all-reduce, then the sums of the rescaled l and acc), as if the states held nothing but the ranks'
# keys. Every rank's state holds the sink, so the merged l holds it P times: its term exp(sink - m) is counted once
# per rank instead of once. Heads without a sink come out right; a row that sees no key on any rank gets l = P
# instead of 1 (out still 0, but lse = sink + log P), and every row of a sink's head weighs the keys too little.
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
    acc, m, l = state  # the bug: every rank's l still holds the sink's term
    m_all = m.clone()
    comm.all_reduce(m_all, op=comm.ReduceOp.MAX)
    m_safe = m_all.masked_fill(torch.isneginf(m_all), 0.0)
    alpha = torch.exp(m - m_safe)
    both = torch.cat([alpha.unsqueeze(-1) * acc, (alpha * l).unsqueeze(-1)], dim=-1)
    comm.all_reduce(both)
    return both[..., :-1], m_all, both[..., -1]
