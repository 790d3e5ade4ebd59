# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3 fixed for every
# rank but the last: the split point and the document starts at chunk edges are right, and the first token after
# each chunk is asked of rank r+1 and of rank r-1, but on rank P-1 the chunk after its first one (chunk P) is its own
# second chunk, not any neighbour's; left IGNORE there, one target per sequence is missing.
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> torch.Tensor:
    P, r = comm.group_size(), comm.group_rank()
    c = (x_r.shape[1] + 1) // 2
    as_target = x_r.masked_fill(starts_r, IGNORE)
    after_first = torch.full_like(x_r[:, :1], IGNORE)
    after_second = torch.full_like(x_r[:, :1], IGNORE)
    my_first, my_second = as_target[:, :1].contiguous(), as_target[:, c : c + 1].contiguous()
    works = []
    if r > 0:
        works += [comm.isend(my_first, r - 1), comm.irecv(after_second, r - 1)]
    if r < P - 1:
        works += [comm.isend(my_second, r + 1), comm.irecv(after_first, r + 1)]
    comm.wait_all(works)
    return torch.cat([as_target[:, 1:c], after_first, as_target[:, c + 1 :], after_second], dim=1)
