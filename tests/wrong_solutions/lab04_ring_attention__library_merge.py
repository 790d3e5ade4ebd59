# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb: the library's merge, pasted in by import. The state is turned
# into lesson 04's form (normalised output, log-sum-exp), merged with parlab.schemes.sequence.ring_attention's
# merge_partials, and turned back (m the larger max, l and acc measured against it). The part asks for the
# student's own merge, and the check names the library call; the ring and the layer call this merge, so they name
# it too (and the rows that saw no key come out NaN: the conversion divides 0 by 0).
# EXPECT FAIL: merge, ring, layer

# ANSWER: merge
from parlab.schemes.sequence.ring_attention import merge_partials


def merge(a, b):
    (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
    out, lse = merge_partials(
        acc_a / l_a.unsqueeze(-1), m_a + torch.log(l_a), acc_b / l_b.unsqueeze(-1), m_b + torch.log(l_b)
    )
    m = torch.maximum(m_a, m_b)
    l = torch.exp(lse - m)
    return out * l.unsqueeze(-1), m, l


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
