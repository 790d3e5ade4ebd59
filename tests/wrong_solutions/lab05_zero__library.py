# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The library's code called: the
# padding is done by parlab.schemes.zero.stages.flatten (the flat, padded buffer of ZeRO's units) instead of by the
# student. Every number and every collective is right; the guard sees the call into parlab's ZeRO and the FAIL line
# names it (schemes/zero/stages.py: flatten).
# EXPECT FAIL: zero1

# ANSWER: zero1
from parlab.schemes.zero.stages import flatten


def init_shard(flat_param: torch.Tensor) -> dict[str, torch.Tensor]:
    N, r = comm.group_size(), comm.group_rank()
    S = math.ceil(len(flat_param) / N)
    master = flatten([flat_param], N * S)[r * S : (r + 1) * S].clone()
    return {"master": master, "m": torch.zeros_like(master), "v": torch.zeros_like(master)}


def zero1_step(flat_param: torch.Tensor, flat_grad: torch.Tensor, state: dict, step: int, lr: float = LR) -> None:
    N = comm.group_size()
    S = len(state["master"])
    padded = flatten([flat_grad], N * S)
    grad = torch.empty(S, dtype=flat_grad.dtype)
    comm.reduce_scatter_tensor(grad, padded)
    grad /= N
    adam_step(state["master"], grad, state["m"], state["v"], step, lr)
    comm.all_gather_into_tensor(padded, state["master"])
    flat_param.copy_(padded[: len(flat_param)])
