# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the merge across ranks gathers every rank's state
# (three all-gathers) and merges the P states on every rank with the student's own merge. Every number is right,
# but each rank receives and holds P states, P times the bytes of the all-reduces the part asks for: with the
# queries of a large batch and many ranks that is the memory the states were meant to save.
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
    P = dist.get_world_size()
    acc, m, l = state
    if dist.get_rank() != 0:  # the sink once: rank 0's
        l = l - torch.where(torch.isneginf(sink).view(-1, 1), 0.0, torch.exp(sink.view(-1, 1) - m))
    gathered = []
    for t in (acc, m, l):  # the bug: every rank's state, on every rank
        parts = [torch.empty_like(t) for _ in range(P)]
        dist.all_gather(parts, t.contiguous())
        gathered.append(parts)
    merged = None
    for acc, m, l in zip(*gathered):
        merged = (acc, m, l) if merged is None else merge(merged, (acc, m, l))
    return merged
