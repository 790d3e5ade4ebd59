# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3 fixed for every
# rank but the last: the split point and the scan along the sequence are right, but on rank P-1 the chunk after its
# first one (chunk P) is its own second chunk, not any neighbour's; left as if it began the sequence, one target per
# sequence is missing and a document running over chunk P-1's end restarts its positions at 0.
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token targets and the positions of this rank's zigzag block. x_r: [B, w] token ids (chunks r and
    2P-1-r of the sequence, side by side); starts_r: [B, w] bool, True where a token begins a document -> targets
    [B, w] (IGNORE where the next token begins another document, and for the sequence's last token) and positions
    [B, w] (each token's place in its document, 0 at its start)."""
    # BEGIN SOLUTION: run the check; then give it data whose every wrong number says where it came from
    P, r = comm.group_size(), comm.group_rank()
    # Where chunk 2P-1-r starts. tensor_split makes the earlier chunks the longer ones, and r < 2P-1-r: chunk r is
    # as long as chunk 2P-1-r or one token longer, so it ends at the block's width halved, rounded up.
    c = (x_r.shape[1] + 1) // 2
    as_target = x_r.masked_fill(starts_r, IGNORE)  # what a token is to the token before it
    pos_first, open_first = restart_positions(starts_r[:, :c])
    pos_second, open_second = restart_positions(starts_r[:, c:])
    # A token's position is a prefix scan along the sequence: it needs the position of the token before it, which
    # needs the one before that, back to its document's start, however many chunks (ranks) away. In sequence order
    # the chunks go up the ranks (0, 1, .., P-1), to chunk P on rank P-1 itself, then down (P-1, .., 0): a path
    # through neighbours. So each rank waits for the position coming into a chunk before it sends the one going out
    # (2P-1 hops in a row, one message each way per rank, each carrying a target and a position per sequence).
    from_prev = torch.full_like(x_r[:, :2], IGNORE)  # [B, 2]: the token after my second chunk, into my first
    from_prev[:, 1] = 0  # rank 0: chunk 0 begins the sequence (a document start)
    if r > 0:
        comm.recv(from_prev, r - 1)
    pos_first = pos_first + open_first * from_prev[:, 1:]
    to_next = torch.cat([as_target[:, c : c + 1], pos_first[:, -1:] + 1], dim=1)  # [B, 2]
    if r < P - 1:
        comm.send(to_next, r + 1)
        from_next = torch.empty_like(to_next)
        comm.recv(from_next, r + 1)
    else:
        from_next = torch.cat([torch.full_like(x_r[:, :1], IGNORE), torch.zeros_like(x_r[:, :1])], dim=1)
    pos_second = pos_second + open_second * from_next[:, 1:]
    if r > 0:
        comm.send(torch.cat([as_target[:, :1], pos_second[:, -1:] + 1], dim=1), r - 1)
    y = torch.cat([as_target[:, 1:c], from_next[:, :1], as_target[:, c + 1 :], from_prev[:, :1]], dim=1)  # [B, w]
    return y, torch.cat([pos_first, pos_second], dim=1)
