# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3's targets made
# right, the split point rounded up and the neighbour's document-start flag sent beside its token (two messages to
# each neighbour: the token ids, then the flags), so the receiver can drop a target that crosses a document's start.
# Every target is right, but each rank now sends four numbers per sequence, twice what the loader may send: the
# check of the traffic catches it (the flag need not travel: the sender knows what its token is to the one before).
# EXPECT FAIL: zigzag_targets

# ANSWER: zigzag_targets
def zigzag_targets(x_r: torch.Tensor, starts_r: torch.Tensor) -> torch.Tensor:
    P, r = comm.group_size(), comm.group_rank()
    w = x_r.shape[1]
    c = (w + 1) // 2
    after_first, first_starts = x_r[:, c : c + 1].clone(), starts_r[:, c : c + 1].clone()
    after_second = torch.full_like(after_first, IGNORE)
    second_starts = torch.zeros_like(first_starts)
    works = []
    if r > 0:
        works += [comm.isend(x_r[:, :1].contiguous(), r - 1), comm.irecv(after_second, r - 1)]
        works += [comm.isend(starts_r[:, :1].contiguous(), r - 1), comm.irecv(second_starts, r - 1)]
    if r < P - 1:
        works += [comm.isend(x_r[:, c : c + 1].contiguous(), r + 1), comm.irecv(after_first, r + 1)]
        works += [comm.isend(starts_r[:, c : c + 1].contiguous(), r + 1), comm.irecv(first_starts, r + 1)]
    comm.wait_all(works)
    after_first = after_first.masked_fill(first_starts, IGNORE)
    after_second = after_second.masked_fill(second_starts, IGNORE)
    y = torch.cat([x_r[:, 1:c], after_first, x_r[:, c + 1 :], after_second], dim=1)
    for lo, hi in ((0, c), (c, w)):
        y[:, lo : hi - 1][starts_r[:, lo + 1 : hi]] = IGNORE
    return y
