# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: no padding. S = Psi // N rounds down, so the N S numbers that are reduce-scattered and
# all-gathered stop short of the end of the flat vector: on 3 ranks the last 2 of the lab model's 22,688 parameters
# (the LM head's last two) are never updated, and each rank holds K x 7,562 bytes of optimizer state instead of
# K x 7,563. No collective complains: every rank hands in the same sizes.
# EXPECT FAIL: zero1

# ANSWER: zero1
def init_shard(flat_param: torch.Tensor) -> dict:
    """This rank's optimizer state: "master" (its shard of flat_param [Psi]), "m" and "v", [S] each, "scale" (the
    loss scale of the first step), and whatever else your steps need (the check counts the bytes of its tensors,
    single numbers aside)."""
    N, r = comm.group_size(), comm.group_rank()
    S = len(flat_param) // N  # rounded down: no padding
    master = flat_param[r * S : (r + 1) * S].clone()  # [S] a copy: this rank's own master weights
    # t: the steps Adam has taken (a skipped step is not one: GradScaler never calls the optimizer)
    # in_a_row: the steps taken since the scale last changed (GradScaler's growth tracker)
    state = {"master": master, "m": torch.zeros_like(master), "v": torch.zeros_like(master), "t": 0}
    return state | {"scale": SCALE0, "in_a_row": 0}


def zero1_step(
    flat_param: torch.Tensor, flat_grad: torch.Tensor, state: dict, lr: float = LR, max_norm: float = MAX_NORM
) -> bool:
    """One step of this rank: True if it updated the parameters (then every rank's model has them), False if the
    step was skipped; state["scale"] becomes the next step's loss scale. flat_param [Psi]: the parameters the model
    computes with; flat_grad [Psi]: state["scale"] times the gradient of this rank's rows; state: init_shard's."""
    N = comm.group_size()
    S = len(state["master"])
    grad = torch.empty(S, dtype=flat_grad.dtype, device=flat_grad.device)
    comm.reduce_scatter_tensor(grad, flat_grad[: N * S])  # [S] the sum over ranks of my slice of their gradients
    # the mean over ranks, unscaled (a power of two: exact). Unscale BEFORE squaring: a finite scaled gradient's
    # square can overflow where the gradient's does not, and would pass for an overflow
    grad /= N * state["scale"]
    # ||g||^2 is the sum over ranks of their shards' sums of squares; an inf or a NaN anywhere makes it one too
    squares = grad.pow(2).sum().reshape(1)  # [1]
    comm.all_reduce(squares)  # every rank: the same number, so every rank takes the same decision
    if not math.isfinite(squares.item()):
        state["scale"], state["in_a_row"] = state["scale"] / 2, 0  # GradScaler's backoff
        return False  # skipped: Adam never sees this step, and the parameters do not change
    state["in_a_row"] += 1
    if state["in_a_row"] == GROWTH:  # GradScaler's growth: the scale doubles after GROWTH good steps in a row
        state["scale"], state["in_a_row"] = state["scale"] * 2, 0
    grad *= min(1.0, max_norm / (math.sqrt(squares.item()) + 1e-6))  # clip_grad_norm_'s factor, whole gradient
    state["t"] += 1
    adam_step(state["master"], grad, state["m"], state["v"], state["t"], lr)  # Adam on my shard only
    comm.all_gather_into_tensor(flat_param[: N * S], state["master"])  # the last Psi - N S never written
    return True
