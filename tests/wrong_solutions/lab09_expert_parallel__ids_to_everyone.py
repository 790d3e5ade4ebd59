# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: every rank sends
# every row's experts to every other rank (an all-gather of the routing) and applies the one-device rule: the mask
# is right, but a rank sends and receives (P - 1) N k = 60 numbers where the budget is 6E = 48: the counts per
# (choice, expert), which is all the rule reads, are fewer.
# EXPECT FAIL: capacity

# ANSWER: capacity
def one_device_rule(all_experts, capacity, experts):
    """[P, N, k] every rank's choices -> keep [P, N, k]: first choices before second, rank order, token order."""
    keep, used = torch.zeros_like(all_experts, dtype=torch.bool), [0] * experts
    for j in range(all_experts.shape[2]):
        for s in range(all_experts.shape[0]):
            for i, e in enumerate(all_experts[s, :, j].tolist()):
                keep[s, i, j] = used[e] < capacity
                used[e] += 1
    return keep


def keep_within_capacity(expert, experts, capacity, group=None):
    P, r = comm.group_size(group), comm.group_rank(group)
    works = [comm.isend(expert, comm.global_rank(group, d), group=group) for d in range(P) if d != r]
    everyone = []
    for s in range(P):
        theirs = expert if s == r else torch.empty_like(expert)
        if s != r:
            comm.recv(theirs, comm.global_rank(group, s), group=group)
        everyone.append(theirs)
    comm.wait_all(works)
    return one_device_rule(torch.stack(everyone), capacity, experts)[r]
