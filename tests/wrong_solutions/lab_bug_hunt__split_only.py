# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3's split point
# rounded up (the earlier chunks are the longer ones), the rest of the loader as handed out: each rank still computes
# the positions it sends from its own chunk alone, all exchanges at once, which is right only while no document runs
# over more than one chunk edge (T = 24 and 23 pack longer ones).
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    P, r = comm.group_size(), comm.group_rank()
    w = x_r.shape[1]
    c = (w + 1) // 2  # where the second chunk starts
    as_target = x_r.masked_fill(starts_r, IGNORE)  # what a token is to the token before it
    pos_first, before_first = restart_positions(starts_r[:, :c])  # [B, c]
    pos_second, before_second = restart_positions(starts_r[:, c:])  # [B, w - c]
    # Per sequence, from each neighbour: [the first token after one of my chunks, the position at which my other
    # chunk begins]. Rank 0's first chunk begins the sequence; rank P-1's second chunk follows its own first chunk.
    from_prev = torch.cat([torch.full_like(x_r[:, :1], IGNORE), torch.zeros_like(x_r[:, :1])], dim=1)  # [B, 2]
    from_next = torch.cat([as_target[:, c : c + 1], pos_first[:, -1:] + 1], dim=1)  # [B, 2]
    works = []
    if r > 0:  # rank r-1 holds chunk r-1 (before my first) and chunk 2P-r (after my second)
        to_prev = torch.cat([as_target[:, :1], pos_second[:, -1:] + 1], dim=1)  # [B, 2]
        works += [comm.isend(to_prev, r - 1), comm.irecv(from_prev, r - 1)]
    if r < P - 1:  # rank r+1 holds chunk r+1 (after my first) and chunk 2P-2-r (before my second)
        to_next = torch.cat([as_target[:, c : c + 1], pos_first[:, -1:] + 1], dim=1)  # [B, 2]
        works += [comm.isend(to_next, r + 1), comm.irecv(from_next, r + 1)]
    comm.wait_all(works)
    pos_first = pos_first + before_first * from_prev[:, 1:]  # the tokens that continue a document from before
    if r == P - 1:
        from_next[:, 1:] = pos_first[:, -1:] + 1
    pos_second = pos_second + before_second * from_next[:, 1:]
    y = torch.cat([as_target[:, 1:c], from_next[:, :1], as_target[:, c + 1 :], from_prev[:, :1]], dim=1)  # [B, w]
    return y, torch.cat([pos_first, pos_second], dim=1)  # [B, w] each
