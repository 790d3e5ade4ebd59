# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: each rank
# sends its counts to every rank after it (and sums what comes from every rank before it): the mask is right, but
# rank 0 sends 3 x E numbers and rank 3 receives 3 x E, when what decides a rank's drops is one sum of E numbers,
# which the rank just before it can hand over.
# EXPECT FAIL: capacity

# ANSWER: capacity
def keep_within_capacity(expert, experts, capacity, group=None):
    P, r = comm.group_size(group), comm.group_rank(group)
    counts = torch.bincount(expert, minlength=experts)
    works = [comm.isend(counts, d, group=group) for d in range(r + 1, P)]  # every later rank gets my counts
    before = torch.zeros_like(counts)
    for s in range(r):
        theirs = torch.empty_like(counts)
        comm.recv(theirs, s, group=group)
        before += theirs
    comm.wait_all(works)
    onehot = F.one_hot(expert, experts)
    mine = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=1)
    return before[expert] + mine < capacity
