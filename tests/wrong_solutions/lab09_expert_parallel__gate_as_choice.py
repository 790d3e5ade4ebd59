# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: a row carries
# the token and its gates, and the destination takes a gate of 0 for an expert the token did not choose. A router
# can hand a chosen expert a gate of exactly 0: that expert is skipped, its output is 0 anyway, but the gradient of
# that gate (its expert's output against the upstream gradient) is lost, and the expert runs one row fewer.
# EXPECT FAIL: combine

# ANSWER: combine
def combine(x, token, expert, gate, weights: dict, experts: int, group=None) -> torch.Tensor:
    """Rank code. x: [N, H] this rank's tokens; token, expert, gate: [n] each, one per assignment (expert: global
    ids); weights: {e: {"gate": [F, H], "up": [F, H], "down": [H, F]}} for the experts this rank holds, keyed by
    global id. Returns y [N, H]. A token travels at most once to each rank, and one row comes back."""
    P, r = comm.group_size(group), comm.group_rank(group)
    per, N, H = experts // P, x.shape[0], x.shape[1]
    dest, local = expert % P, expert // P  # [n] the rank of each assignment's expert, its place among that rank's
    pairs, slot = torch.unique(dest * N + token, return_inverse=True)  # [m] (destination, token), by destination
    pair_token = pairs % N  # [m] the token of each row
    gates = torch.zeros(len(pairs), per, dtype=x.dtype, device=x.device)
    gates = gates.index_put((slot, local), gate)  # [m, E/P]: the destination's gates for the token
    send = torch.bincount(pairs // N, minlength=P)  # [P] rows to each rank
    recv, sends = swap_counts(send.view(P, 1), group)  # [P, 1] rows from each rank; [P, P] rows s -> d
    rows = torch.cat([x[pair_token], gates], dim=1)  # [m, H + 2 E/P]: 80 bytes a row here
    received = Shuffle.apply(rows, recv.view(P).tolist(), send.tolist(), sends, group)  # [R, H + 2 E/P]
    h, g = received[:, :H], received[:, H:]
    out = torch.zeros_like(h)
    for j in range(per):  # local expert j is global expert r + j P; it runs on the rows that chose it, only those
        mine = (g[:, j] != 0).nonzero().flatten()  # a token chose the expert if its gate is not 0
        w = weights[r + j * P]
        y_j = (F.silu(h[mine] @ w["gate"].T) * (h[mine] @ w["up"].T)) @ w["down"].T  # [rows, H]
        out = out.index_add(0, mine, g[mine, j : j + 1] * y_j)
    back = Shuffle.apply(out, send.tolist(), recv.view(P).tolist(), sends.T, group)  # [m, H], in my rows' order
    return torch.zeros_like(x).index_add(0, pair_token, back)
