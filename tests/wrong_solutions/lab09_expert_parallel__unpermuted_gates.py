# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb. The bug: the results come back in the order the rows were
# sent (grouped by destination rank, then expert), and this combine adds them into their tokens (token[order],
# right) but weights them with the gates in the rows' original order (gate, not gate[order]): each result gets
# another assignment's gate. The traffic is right; y and its gradients are not one device's.
# EXPECT FAIL: combine, capacity

# ANSWER: combine
def combine(x, token, expert, gate, weights, experts, group=None):
    received, recv_counts, order = dispatch(x[token], expert, experts, group)
    P, per = recv_counts.shape
    r = comm.group_rank(group)
    local = torch.arange(per).repeat(P).repeat_interleave(recv_counts.reshape(-1))
    out = torch.zeros_like(received)
    for j in range(per):
        rows = (local == j).nonzero().flatten()
        out = out.index_add(0, rows, checks.expert(weights[r + j * P], received[rows]))
    send_splits = torch.bincount(expert % P, minlength=P).tolist()
    back = Shuffle.apply(out, send_splits, recv_counts.sum(dim=1).tolist(), group)
    return torch.zeros_like(x).index_add(0, token[order], gate.unsqueeze(-1) * back)
