# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The checks' reference
# called: each rank regenerates every other rank's routing with the reference's seeded layer_inputs (importable like
# any module) and counts the slots the lower ranks take without exchanging anything. The kept assignments are right;
# but a rank has read the other ranks' rows, which the lab forbids, and the check sees the calls.
# EXPECT FAIL: capacity

# ANSWER: capacity
def keep_within_capacity(expert, experts, capacity, group=None):
    from parlab.grading.labs.lab09_reference import layer_inputs

    r = comm.group_rank(group)
    before = torch.zeros(experts, dtype=torch.long)
    for s in range(r):  # the lower ranks' assignments, read off the reference instead of exchanged
        before += torch.bincount(layer_inputs(s)[1].reshape(-1), minlength=experts)
    onehot = F.one_hot(expert, experts)
    mine = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=1)
    return before.to(expert.device)[expert] + mine < capacity
