# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3's split point
# fixed where the first FAIL pointed (rank 0, whose chunk 0 is one token longer than its chunk 2P-1 when 2P does not
# divide T) and nowhere else: the other ranks whose two chunks differ in length (at T = 20 all of them, rank P-1's
# chunks P-1 and P included) still cut their block in the middle. The document starts at chunk edges are handled.
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> torch.Tensor:
    P, r = comm.group_size(), comm.group_rank()
    c = x_r.shape[1] // 2 + (1 if r == 0 and x_r.shape[1] % 2 else 0)
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
