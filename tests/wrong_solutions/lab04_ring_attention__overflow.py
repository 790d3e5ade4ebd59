# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the merge writes each rescaling factor as it reads on
# paper, exp(m_a) / exp(m), instead of exp(m_a - m). Right for ordinary scores (the ring and the layer pass), but
# with scores in the thousands exp(m) is inf in float64 (inf / inf: NaN), and a row that saw no key in either block
# divides 0 by 0.
# EXPECT FAIL: merge

# ANSWER: merge
def merge(a, b):
    acc_a, m_a, l_a = a
    acc_b, m_b, l_b = b
    m = torch.maximum(m_a, m_b)
    alpha, beta = torch.exp(m_a) / torch.exp(m), torch.exp(m_b) / torch.exp(m)
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
    m_safe = m_all.masked_fill(torch.isneginf(m_all), 0.0)
    alpha = torch.exp(m - m_safe)
    both = torch.cat([alpha.unsqueeze(-1) * acc, (alpha * l).unsqueeze(-1)], dim=-1)
    comm.all_reduce(both)
    return both[..., :-1], m_all, both[..., -1]
