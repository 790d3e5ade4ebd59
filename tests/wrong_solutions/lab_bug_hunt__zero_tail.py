# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: part 4's frozen tail "fixed" by handling the last Psi mod P elements apart: every rank all-reduces their
# gradient and keeps its own copy of their master weights and Adam moments. The parameters match one device, but
# the tail's state is replicated on every rank (not ZeRO) and costs an extra all-reduce per step.
# EXPECT FAIL: zero_padding

# ANSWER: zero_update
def zero_update(flat_param, flat_grad, state, step):
    P, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // P
    if not state:
        state["master"] = flat_param[r * S : (r + 1) * S].clone()
        state["m"], state["v"] = torch.zeros(S, dtype=torch.float64), torch.zeros(S, dtype=torch.float64)
        state["tail"] = flat_param[P * S :].clone()
        state["tail_m"], state["tail_v"] = torch.zeros_like(state["tail"]), torch.zeros_like(state["tail"])
    grad = torch.empty(S, dtype=torch.float64)
    comm.reduce_scatter_tensor(grad, flat_grad[: P * S])
    grad /= P
    adam_step(state["master"], grad, state["m"], state["v"], step, ZERO_LR)
    tail_grad = flat_grad[P * S :].clone()
    comm.all_reduce(tail_grad)
    tail_grad /= P
    adam_step(state["tail"], tail_grad, state["tail_m"], state["tail_v"], step, ZERO_LR)
    comm.all_gather_into_tensor(flat_param[: P * S], state["master"])
    flat_param[P * S :] = state["tail"]
