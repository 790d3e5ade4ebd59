# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the
# (token, destination) rows are numbered token first (token * P + destination), so they come out sorted by token,
# not grouped by destination, while the split sizes count rows per destination: the shuffle cuts the rows
# into consecutive chunks, and a rank gets another rank's tokens. The traffic is right; y and its gradients are not.
# EXPECT FAIL: combine, capacity

# ANSWER: combine
def combine(x, token, expert, gate, weights, experts, group=None):
    P, r = comm.group_size(group), comm.group_rank(group)
    per, N, H = experts // P, x.shape[0], x.shape[1]
    dest, local = expert % P, expert // P
    pairs, slot = torch.unique(token * P + dest, return_inverse=True)  # by token, then destination
    pair_dest, pair_token = pairs % P, pairs // P
    gates = torch.zeros(len(pairs), per, dtype=x.dtype, device=x.device).index_put((slot, local), gate)
    send = torch.bincount(pair_dest, minlength=P)
    recv = swap_counts(send.view(P, 1), group).view(P)
    received = Shuffle.apply(torch.cat([x[pair_token], gates], dim=1), recv.tolist(), send.tolist(), group)
    h, g = received[:, :H], received[:, H:]
    out = torch.zeros_like(h)
    for j in range(per):
        mine = (g[:, j] != 0).nonzero().flatten()
        w = weights[r + j * P]
        y_j = (F.silu(h[mine] @ w["gate"].T) * (h[mine] @ w["up"].T)) @ w["down"].T
        out = out.index_add(0, mine, g[mine, j : j + 1] * y_j)
    back = Shuffle.apply(out, send.tolist(), recv.tolist(), group)
    return torch.zeros_like(x).index_add(0, pair_token, back)
