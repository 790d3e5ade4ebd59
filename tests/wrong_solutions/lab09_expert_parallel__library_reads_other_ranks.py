# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The checks' reference
# called: each rank regenerates every other rank's routing with the reference's seeded layer_inputs (importable like
# any module) and applies the one-device rule without exchanging anything. The kept assignments are right; but a
# rank has read the other ranks' rows, which the lab forbids, and the check sees the calls.
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
    from parlab.grading.labs.lab09_reference import layer_inputs

    r, P = comm.group_rank(group), comm.group_size(group)
    everyone = torch.stack([layer_inputs(s)[1] for s in range(P)])  # read off the reference instead of exchanged
    return one_device_rule(everyone, capacity, experts)[r].to(expert.device)
