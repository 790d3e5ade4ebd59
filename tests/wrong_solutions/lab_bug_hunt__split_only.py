# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3 fixed for the
# cause the lengths show (tensor_split's first chunk is the longer one: the split point rounded up) and not for the
# one the documents show: where a document begins at the first token of a chunk, the token before it (the last of
# the previous chunk, held by a neighbour, or by rank P-1 itself between chunks P-1 and P) still gets that token as
# its target. Exact at T = 16 and 20 (every document starts inside a chunk), off at T = 24 and 23.
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> torch.Tensor:
    P, r = comm.group_size(), comm.group_rank()
    w = x_r.shape[1]
    c = (w + 1) // 2
    after_first = x_r[:, c : c + 1].clone()
    after_second = torch.full_like(after_first, IGNORE)
    my_first, my_second = x_r[:, :1].contiguous(), x_r[:, c : c + 1].contiguous()
    works = []
    if r > 0:
        works += [comm.isend(my_first, r - 1), comm.irecv(after_second, r - 1)]
    if r < P - 1:
        works += [comm.isend(my_second, r + 1), comm.irecv(after_first, r + 1)]
    comm.wait_all(works)
    y = torch.cat([x_r[:, 1:c], after_first, x_r[:, c + 1 :], after_second], dim=1)
    for lo, hi in ((0, c), (c, w)):
        y[:, lo : hi - 1][starts_r[:, lo + 1 : hi]] = IGNORE
    return y
