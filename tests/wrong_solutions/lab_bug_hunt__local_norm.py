# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 4's overcounted
# gains "fixed" by leaving the all-reduce of the squares out: each rank clips by the norm of its own shard and the
# gains. No number is counted twice now, but each rank sees only a quarter of the matrices: the ranks clip by
# different, too small norms, and every parameter drifts from one device's.
# EXPECT FAIL: zero_clip

# ANSWER: zero_step
def zero_step(flat_param, flat_grad, gains, state, step):
    P, r = comm.group_size(), comm.group_rank()
    S = math.ceil(flat_param.numel() / P)
    pad = P * S - flat_param.numel()
    if not state:
        state["master"] = F.pad(flat_param, (0, pad))[r * S : (r + 1) * S].clone()
        state["m"], state["v"] = torch.zeros_like(state["master"]), torch.zeros_like(state["master"])
        state["gains_m"] = [torch.zeros_like(g) for g in gains]
        state["gains_v"] = [torch.zeros_like(g) for g in gains]
    grad = torch.empty_like(state["master"])
    comm.reduce_scatter_tensor(grad, F.pad(flat_grad, (0, pad)))
    grad /= P
    for g in gains:
        comm.all_reduce(g.grad)
        g.grad /= P
    squares = grad.pow(2).sum() + sum(g.grad.pow(2).sum() for g in gains)
    state["grad_norm"] = squares.sqrt()
    coef = clip_coefficient(state["grad_norm"])
    adam_step(state["master"], grad * coef, state["m"], state["v"], step, ZERO_LR)
    for g, m, v in zip(gains, state["gains_m"], state["gains_v"]):
        adam_step(g.data, g.grad * coef, m, v, step, ZERO_LR)
    gathered = torch.empty(P * S, dtype=flat_param.dtype, device=flat_param.device)
    comm.all_gather_into_tensor(gathered, state["master"])
    flat_param.copy_(gathered[: flat_param.numel()])
