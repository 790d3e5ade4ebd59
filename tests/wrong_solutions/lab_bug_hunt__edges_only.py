# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3 fixed for the
# cause the documents show (each rank sends its neighbour the target its edge token makes, IGNORE where it begins a
# document, instead of the token) and not for the one the lengths show: the block is still cut in the middle, but
# tensor_split's first chunks are one token longer when 2P does not divide T. Exact at T = 16 and 24, off at T = 20
# and 23.
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> torch.Tensor:
    P, r = comm.group_size(), comm.group_rank()
    c = x_r.shape[1] // 2
    as_target = x_r.masked_fill(starts_r, IGNORE)
    after_first = as_target[:, c : c + 1].clone()
    after_second = torch.full_like(after_first, IGNORE)
    my_first, my_second = as_target[:, :1].contiguous(), as_target[:, c : c + 1].contiguous()
    works = []
    if r > 0:
        works += [comm.isend(my_first, r - 1), comm.irecv(after_second, r - 1)]
    if r < P - 1:
        works += [comm.isend(my_second, r + 1), comm.irecv(after_first, r + 1)]
    comm.wait_all(works)
    return torch.cat([as_target[:, 1:c], after_first, as_target[:, c + 1 :], after_second], dim=1)
