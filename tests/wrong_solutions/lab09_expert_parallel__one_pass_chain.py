# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: first choices
# before second choices, but counted from the lower ranks only (one pass up a chain): a rank's second choices are
# placed after every lower rank's first and second choices and its own first choices, but the higher ranks'
# first choices, which are ahead of them too, are never heard of. The sizes are within the budget; the kept
# assignments of every rank but the last are not one device's.
# EXPECT FAIL: capacity

# ANSWER: capacity
def keep_within_capacity(expert, experts, capacity, group=None):
    P, r = comm.group_size(group), comm.group_rank(group)
    onehot = F.one_hot(expert, experts)  # [N, k, E]
    counts = onehot.sum(dim=0)  # [k, E]
    before = torch.zeros_like(counts)
    if r > 0:
        comm.recv(before, comm.global_rank(group, r - 1), group=group)
    if r < P - 1:
        comm.send(before + counts, comm.global_rank(group, r + 1), group=group)
    known = before + counts  # ranks 0..r only: taken for every rank's
    ahead = known.cumsum(dim=0) - known + before
    mine = onehot.cumsum(dim=0) - onehot
    slot = (ahead.unsqueeze(0) + mine).gather(2, expert.unsqueeze(2)).squeeze(2)
    return slot < capacity
