# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: no padding. S = Psi // N rounds down, so the N S numbers that are reduce-scattered and
# all-gathered stop short of the end of the flat vector: on 3 ranks the last 2 of the lab model's 22,688 parameters
# (the LM head's last two) are never updated, and each rank holds K x 7,562 bytes of optimizer state instead of
# K x 7,563. No collective complains: every rank hands in the same sizes.
# EXPECT FAIL: zero1

# ANSWER: zero1
def init_shard(flat_param: torch.Tensor) -> dict:
    """This rank's optimizer state: "master" (its shard of flat_param [Psi]), "m" and "v", [S] each, and whatever
    else your steps need (the check counts the bytes of its tensors, single numbers aside)."""
    N, r = comm.group_size(), comm.group_rank()
    S = len(flat_param) // N  # rounded down: no padding
    master = flat_param[r * S : (r + 1) * S].clone()  # [S] a copy: this rank's own master weights
    # t: the steps Adam has taken (a skipped step is not one: GradScaler never calls the optimizer)
    return {"master": master, "m": torch.zeros_like(master), "v": torch.zeros_like(master), "t": 0}


def zero1_step(
    flat_param: torch.Tensor, flat_grad: torch.Tensor, state: dict, lr: float = LR, max_norm: float = MAX_NORM
) -> bool:
    """One step of this rank: True if it updated the parameters (then every rank's model has them), False if the
    step was skipped. flat_param [Psi]: the parameters the model computes with; flat_grad [Psi]: the gradient of
    this rank's rows; state: init_shard's dict."""
    N = comm.group_size()
    S = len(state["master"])
    grad = torch.empty(S, dtype=flat_grad.dtype, device=flat_grad.device)
    comm.reduce_scatter_tensor(grad, flat_grad[: N * S])  # [S] the sum over ranks of my slice of their gradients
    grad /= N  # the mean over ranks: my slice of the whole batch's gradient
    # ||g||^2 is the sum over ranks of their shards' sums of squares; an inf or a NaN anywhere makes it one too
    squares = grad.pow(2).sum().reshape(1)  # [1]
    comm.all_reduce(squares)  # every rank: the same number, so every rank takes the same decision
    norm = math.sqrt(squares.item()) if math.isfinite(squares.item()) else math.nan
    if not math.isfinite(norm):
        return False  # skipped: Adam never sees this step, and the parameters do not change
    grad *= min(1.0, max_norm / (norm + 1e-6))  # clip_grad_norm_'s factor, for the whole gradient
    state["t"] += 1
    adam_step(state["master"], grad, state["m"], state["v"], state["t"], lr)  # Adam on my shard only
    comm.all_gather_into_tensor(flat_param[: N * S], state["master"])  # the last Psi - N S never written
    return True
