# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: an expert's
# place among its rank's experts taken as expert % (E/P), as for the lesson's contiguous blocks. Under round-robin
# rank r holds experts r and r + 4, which both give r % 2: a token that chose both writes both gates into one
# column, and the destination runs the wrong expert on the other. The rows and their messages are right.
# EXPECT FAIL: combine, capacity

# ANSWER: combine
def combine(x, token, expert, gate, weights: dict, experts: int, group=None) -> torch.Tensor:
    """Rank code. x: [N, H] this rank's tokens; token, expert, gate: [n] each, one per assignment (expert: global
    ids); weights: {e: {"gate": [F, H], "up": [F, H], "down": [H, F]}} for the experts this rank holds, keyed by
    global id. Returns y [N, H]. A token travels at most once to each rank, and one row comes back."""
    P, r = comm.group_size(group), comm.group_rank(group)
    per, N, H = experts // P, x.shape[0], x.shape[1]
    dest, local = (
        expert % P,
        expert % per,
    )  # the place of an expert in a contiguous block  # [n] the rank of each assignment's expert, its place among that rank's
    pairs, slot = torch.unique(dest * N + token, return_inverse=True)  # [m] (destination, token), by destination
    pair_token = pairs % N  # [m] the token of each row
    gates = torch.zeros(len(pairs), per, dtype=x.dtype, device=x.device)
    gates = gates.index_put((slot, local), gate)  # [m, E/P]: the destination's gates for the token
    chose = torch.zeros(len(pairs), per, dtype=x.dtype, device=x.device)
    chose[slot, local] = 1.0  # [m, E/P]: which experts it chose; a gate may be exactly 0 and still be chosen
    send = torch.bincount(pairs // N, minlength=P)  # [P] rows to each rank
    recv, sends = swap_counts(send.view(P, 1), group)  # [P, 1] rows from each rank; [P, P] rows s -> d
    rows = torch.cat([x[pair_token], gates, chose], dim=1)  # [m, H + 2 E/P]: 80 bytes a row here
    received = Shuffle.apply(rows, recv.view(P).tolist(), send.tolist(), sends, group)  # [R, H + 2 E/P]
    h, g, c = received[:, :H], received[:, H : H + per], received[:, H + per :]
    out = torch.zeros_like(h)
    for j in range(per):  # local expert j is global expert r + j P; it runs on the rows that chose it, only those
        mine = (c[:, j] > 0).nonzero().flatten()
        w = weights[r + j * P]
        y_j = (F.silu(h[mine] @ w["gate"].T) * (h[mine] @ w["up"].T)) @ w["down"].T  # [rows, H]
        out = out.index_add(0, mine, g[mine, j : j + 1] * y_j)
    back = Shuffle.apply(out, send.tolist(), recv.view(P).tolist(), sends.T, group)  # [m, H], in my rows' order
    return torch.zeros_like(x).index_add(0, pair_token, back)
