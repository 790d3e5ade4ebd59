# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The lesson's layer: one
# row per assignment (part 1's dispatch), each expert's output weighted at home. y and every gradient are right, but
# a token whose two experts live on the same rank travels there twice and two rows come back: the messages carry one
# row per assignment, not one per (token, destination).
# EXPECT FAIL: combine, capacity

# ANSWER: combine
def combine(x, token, expert, gate, weights, experts, group=None):
    received, recv_counts, order = dispatch(x[token], expert, experts, group)
    P, per = recv_counts.shape
    r = comm.group_rank(group)
    local = torch.arange(per, device=x.device).repeat(P).repeat_interleave(recv_counts.reshape(-1))
    out = torch.zeros_like(received)
    for j in range(per):
        rows = (local == j).nonzero().flatten()
        w = weights[r + j * P]
        y_j = (F.silu(received[rows] @ w["gate"].T) * (received[rows] @ w["up"].T)) @ w["down"].T
        out = out.index_add(0, rows, y_j)
    send_splits = torch.bincount(expert % P, minlength=P)
    _, sends = swap_counts(send_splits.view(P, 1), group)  # who sent whom rows: the way back is its transpose
    back = Shuffle.apply(out, send_splits.tolist(), recv_counts.sum(dim=1).tolist(), sends.T, group)
    return torch.zeros_like(x).index_add(0, token[order], gate[order].unsqueeze(-1) * back)
