# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's).
# The bug: part 4 fixed for the user's layout only. The shards' squares are all-reduced over all ranks, which
# counts every shard once per replica, so the sum is divided by 2, the number of replicas on the user's two nodes,
# written as a constant; the gains' squares are added once. Right with shard groups of 2 (2 replicas), wrong on any
# other layout: with one shard group of 4 ranks (1 replica) the matrices' part of the squared norm comes out halved.
# EXPECT FAIL: zero_clip

# ANSWER: zero_step
def zero_step(flat_param, flat_grad, gains, state, step, shard_group, replica_group):
    N, G = comm.group_size(), comm.group_size(shard_group)
    r = comm.group_rank(shard_group)
    S = math.ceil(flat_param.numel() / G)
    pad = G * S - flat_param.numel()
    if not state:
        state["master"] = F.pad(flat_param, (0, pad))[r * S : (r + 1) * S].clone()
        state["m"], state["v"] = torch.zeros_like(state["master"]), torch.zeros_like(state["master"])
        state["gains_m"] = [torch.zeros_like(g) for g in gains]
        state["gains_v"] = [torch.zeros_like(g) for g in gains]
    grad = torch.empty_like(state["master"])
    comm.reduce_scatter_tensor(grad, F.pad(flat_grad, (0, pad)), group=shard_group)
    comm.all_reduce(grad, group=replica_group)
    grad /= N
    for g in gains:
        comm.all_reduce(g.grad)
        g.grad /= N
    squares = grad.pow(2).sum()
    comm.all_reduce(squares)
    squares = squares / 2 + sum(g.grad.pow(2).sum() for g in gains)
    state["grad_norm"] = squares.sqrt()
    coef = clip_coefficient(state["grad_norm"])
    adam_step(state["master"], grad * coef, state["m"], state["v"], step, ZERO_LR)
    for g, m, v in zip(gains, state["gains_m"], state["gains_v"]):
        adam_step(g.data, g.grad * coef, m, v, step, ZERO_LR)
    gathered = torch.empty(G * S, dtype=flat_param.dtype, device=flat_param.device)
    comm.all_gather_into_tensor(gathered, state["master"], group=shard_group)
    flat_param.copy_(gathered[: flat_param.numel()])
