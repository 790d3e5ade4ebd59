# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3's positions made
# right with concurrent exchanges, as many rounds as the path of chunks is long (2P-2): every target and position is
# right, but each rank sends 2P-1 numbers per sequence to each neighbour instead of two; the traffic check catches it
# (the numbers the loader sends already suffice when each rank waits for the one coming in).
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    P, r = comm.group_size(), comm.group_rank()
    c = (x_r.shape[1] + 1) // 2
    as_target = x_r.masked_fill(starts_r, IGNORE)
    pos_first, before_first = restart_positions(starts_r[:, :c])
    pos_second, before_second = restart_positions(starts_r[:, c:])

    # A stretch's summary, one number per sequence: s >= 0, the position after it, known; s < 0, it holds no
    # start, and the position after it is the one before it plus -s - 1.
    def own(pos, before):
        return torch.where(before[:, -1:] == 1, -pos[:, -1:] - 2, pos[:, -1:] + 1)

    def then(a, b):  # stretch a, then stretch b
        return torch.where(b >= 0, b, torch.where(a >= 0, a - b - 1, a + b + 1))

    s1, s2 = own(pos_first, before_first), own(pos_second, before_second)
    in_first = torch.full_like(s1, 0 if r == 0 else -1)  # rank 0: the sequence starts at position 0
    in_second = then(in_first, s1) if r == P - 1 else torch.full_like(s2, -1)
    from_prev = torch.full_like(x_r[:, :1], IGNORE)
    from_next = as_target[:, c : c + 1].clone()
    for k in range(2 * P - 2):  # each round, what I know of the sequence before each chunk of mine, one hop further
        works, got_first, got_second = [], in_first.clone(), in_second.clone()
        up, down = then(in_first, s1), then(in_second, s2)
        if k == 0:  # the targets travel with the first round
            up, down = torch.cat([as_target[:, c : c + 1], up], 1), torch.cat([as_target[:, :1], down], 1)
        recv_prev, recv_next = torch.empty_like(down), torch.empty_like(up)
        if r > 0:
            works += [comm.isend(down.contiguous(), r - 1), comm.irecv(recv_prev, r - 1)]
        if r < P - 1:
            works += [comm.isend(up.contiguous(), r + 1), comm.irecv(recv_next, r + 1)]
        comm.wait_all(works)
        if k == 0:
            if r > 0:
                from_prev, recv_prev = recv_prev[:, :1], recv_prev[:, 1:]
            if r < P - 1:
                from_next, recv_next = recv_next[:, :1], recv_next[:, 1:]
        in_first = recv_prev if r > 0 else in_first
        in_second = recv_next if r < P - 1 else then(in_first, s1)
    known = lambda s: torch.where(s >= 0, s, -s - 1)  # noqa: E731  (still open after the last round: from 0)
    pos_first = pos_first + before_first * known(in_first)
    pos_second = pos_second + before_second * known(in_second)
    y = torch.cat([as_target[:, 1:c], from_next, as_target[:, c + 1 :], from_prev], dim=1)
    return y, torch.cat([pos_first, pos_second], dim=1)
