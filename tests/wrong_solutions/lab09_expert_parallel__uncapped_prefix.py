# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the chain
# passes on the exact counts of the lower ranks, not what they took: the mask is right and the sizes within the
# budget, but a busy expert's number grows past C, telling the next rank more than can change any of its drops
# (what ranks 0..r took of an expert is at most C).
# EXPECT FAIL: capacity

# ANSWER: capacity
def keep_within_capacity(expert, experts, capacity, group=None):
    P, r = comm.group_size(group), comm.group_rank(group)
    counts = torch.bincount(expert, minlength=experts)
    before = torch.zeros_like(counts)
    if r > 0:
        comm.recv(before, comm.global_rank(group, r - 1), group=group)
    if r < P - 1:
        comm.send(before + counts, comm.global_rank(group, r + 1), group=group)  # uncapped
    onehot = F.one_hot(expert, experts)
    mine = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=1)
    return before[expert] + mine < capacity
