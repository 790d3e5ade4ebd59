# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb (found by a student: it once scored full marks). The bug: the
# merge guards the wrong maximum. It measures both blocks against the new max m, but where block a saw no key it
# takes 0 as the reference instead of m: right when both blocks are empty, and when only b is, but where a is empty
# and b is not, b's factor is exp(m_b - 0) = exp(m_b) instead of 1 (l and acc come out e^(m_b) times too large,
# inf with scores in the thousands). In the ring and the layer the first state of a rank always sees a key (its own
# block comes first), so they pass.
# EXPECT FAIL: merge

# ANSWER: merge
def merge(a, b):
    acc_a, m_a, l_a = a
    acc_b, m_b, l_b = b
    m = torch.maximum(m_a, m_b)
    ref = torch.where(torch.isneginf(m_a), torch.zeros_like(m), m)  # the bug: m_a, where m was meant
    alpha, beta = torch.exp(m_a - ref), torch.exp(m_b - ref)
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
