# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: no padding. S = Psi // N rounds down, so the N S numbers that are reduce-scattered and
# all-gathered stop short of the end of the flat vector: on 3 ranks the last 2 of the lab model's 22,688 parameters
# (the LM head's last two) are never updated, and each rank holds K x 7,562 bytes of optimizer state instead of
# K x 7,563. No collective complains: every rank hands in the same sizes.
# EXPECT FAIL: zero1

# ANSWER: zero1
def init_shard(flat_param: torch.Tensor) -> dict[str, torch.Tensor]:
    N, r = comm.group_size(), comm.group_rank()
    S = len(flat_param) // N
    master = flat_param[r * S : (r + 1) * S].clone()
    return {"master": master, "m": torch.zeros_like(master), "v": torch.zeros_like(master)}


def zero1_step(flat_param: torch.Tensor, flat_grad: torch.Tensor, state: dict, step: int, lr: float = LR) -> None:
    N = comm.group_size()
    S = len(flat_param) // N
    grad = torch.empty(S, dtype=flat_grad.dtype)
    comm.reduce_scatter_tensor(grad, flat_grad[: N * S])
    grad /= N
    adam_step(state["master"], grad, state["m"], state["v"], step, lr)
    comm.all_gather_into_tensor(flat_param[: N * S], state["master"])
