# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3 'fixed' by
# gathering every rank's block of token ids and of document-start flags (each rank's width first: the blocks differ
# by a token when 2P does not divide T), putting the whole sequence back together and building its targets and
# positions on every rank. They are right, but every rank now holds the whole sequence (the thing context parallelism
# exists to avoid) and sends its whole block to everyone: the check of whom each rank exchanges with catches it.
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    P, r = comm.group_size(), comm.group_rank()
    widths = [torch.zeros(1, dtype=torch.int64, device=x_r.device) for _ in range(P)]
    comm.all_gather(widths, torch.tensor([x_r.shape[1]], device=x_r.device))
    widths = [int(w) for w in widths]
    mine = torch.stack([x_r, starts_r.to(x_r.dtype)])  # [2, B, w]: ids and flags
    blocks = [torch.empty(2, x_r.shape[0], w, dtype=x_r.dtype, device=x_r.device) for w in widths]
    for j in range(P):  # each rank's block broadcast from it
        if j == r:
            blocks[j].copy_(mine)
        comm.broadcast(blocks[j], src=j)
    chunks = [None] * (2 * P)
    for j, block in enumerate(blocks):
        c = (block.shape[2] + 1) // 2
        chunks[j], chunks[2 * P - 1 - j] = block[:, :, :c], block[:, :, c:]
    x, starts = torch.cat(chunks, dim=2)
    y = torch.full_like(x, IGNORE)
    y[:, :-1] = x[:, 1:].masked_fill(starts[:, 1:].bool(), IGNORE)
    pos, _ = restart_positions(starts.bool())  # the whole sequence begins with a document
    sizes = [t.shape[2] for t in chunks]
    at = [sum(sizes[:i]) for i in range(2 * P)]
    first, second = r, 2 * P - 1 - r
    mine = lambda t: torch.cat([t[:, at[i] : at[i] + sizes[i]] for i in (first, second)], dim=1)  # noqa: E731
    return mine(y), mine(pos)
