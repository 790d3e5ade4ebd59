# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3 "fixed" by
# all-gathering every rank's block, putting the whole sequence back together and shifting it on every rank. The
# targets are right, but every rank now holds the whole sequence (the thing context parallelism exists to avoid) and
# sends its whole block to everyone: the check of whom each rank exchanges with catches it.
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor) -> torch.Tensor:
    P, r = comm.group_size(), comm.group_rank()
    blocks = [torch.empty_like(x_r) for _ in range(P)]
    comm.all_gather(blocks, x_r.contiguous())
    c = x_r.shape[1] // 2
    chunks = [None] * (2 * P)
    for j, block in enumerate(blocks):
        chunks[j], chunks[2 * P - 1 - j] = block[:, :c], block[:, c:]
    x = torch.cat(chunks, dim=1)
    y = torch.full_like(x, IGNORE)
    y[:, :-1] = x[:, 1:]
    return torch.cat([y[:, r * c : (r + 1) * c], y[:, (2 * P - 1 - r) * c : (2 * P - r) * c]], dim=1)
