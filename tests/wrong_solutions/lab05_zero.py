# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: the reduce-scattered gradient is the SUM over ranks, never divided by N. Adam divides m by sqrt(v), so a
# gradient N times too large changes the step only through eps: by ~1e-8 here, far beyond float64's tolerance of
# 1e-10. The bytes are right; the parameters are not.
# EXPECT FAIL: step, training

# ANSWER: zero_step
def zero_step(flat_param: torch.Tensor, flat_grad: torch.Tensor, state: dict, step: int, lr: float = LR) -> None:
    N = comm.group_size()
    S = len(flat_param) // N
    grad = torch.empty(S, dtype=flat_grad.dtype)
    comm.reduce_scatter_tensor(grad, flat_grad)
    adam_step(state["master"], grad, state["m"], state["v"], step, lr)
    comm.all_gather_into_tensor(flat_param, state["master"])
