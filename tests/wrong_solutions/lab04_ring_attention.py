# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb (tests/test_labs.py grades it; the other answers are the
# solution's). The bug: the merge forgets to rescale. It takes the larger max as the new m but adds the two
# accumulators and the two sums as they are, each still measured against its own block's max: a block whose max is
# below the new one weighs exp(m - m_x) times too much. The ring and the attention layer use this merge, so their
# outputs are wrong too.
# EXPECT FAIL: merge, ring, layer

# ANSWER: merge
def merge(a, b):
    acc_a, m_a, l_a = a
    acc_b, m_b, l_b = b
    return acc_a + acc_b, torch.maximum(m_a, m_b), l_a + l_b


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
