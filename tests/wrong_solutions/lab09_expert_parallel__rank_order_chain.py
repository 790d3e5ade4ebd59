# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the slots handed
# out in rank order, then row order (the rule a chain of prefix counts serves, here with the lower ranks' exact,
# uncapped counts), not first choices before second: a low rank's second choice takes a slot that a higher rank's
# first choice should have. The sizes are within the budget; the kept assignments are not one device's.
# EXPECT FAIL: capacity

# ANSWER: capacity
def keep_within_capacity(expert, experts, capacity, group=None):
    P, r = comm.group_size(group), comm.group_rank(group)
    flat = expert.reshape(-1)  # token-major: a token's first choice, then its second
    counts = torch.bincount(flat, minlength=experts)
    before = torch.zeros_like(counts)
    if r > 0:
        comm.recv(before, comm.global_rank(group, r - 1), group=group)
    if r < P - 1:
        comm.send(before + counts, comm.global_rank(group, r + 1), group=group)  # uncapped
    onehot = F.one_hot(flat, experts)
    mine = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=1)
    return (before[flat] + mine < capacity).reshape(expert.shape)
