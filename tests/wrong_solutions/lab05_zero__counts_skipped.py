# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: Adam's step count t
# goes up in every step, the skipped ones too. Every rank skips the right steps and the traffic is right, but from
# step 4 on Adam's bias correction uses t = 4 where one device, whose optimizer never saw the skipped step 3, uses
# 3: the parameters and m differ after step 4.
# EXPECT FAIL: zero1

# ANSWER: zero1
def init_shard(flat_param: torch.Tensor) -> dict:
    """This rank's optimizer state: "master" (its shard of flat_param [Psi]), "m" and "v", [S] each, "scale" (the
    loss scale of the first step), and whatever else your steps need (the check counts the bytes of its tensors,
    single numbers aside)."""
    N, r = comm.group_size(), comm.group_rank()
    S = math.ceil(len(flat_param) / N)  # the shard size; the last rank's shard ends in the padding
    padded = torch.zeros(N * S, dtype=flat_param.dtype, device=flat_param.device)
    padded[: len(flat_param)] = flat_param
    master = padded[r * S : (r + 1) * S].clone()  # [S] a copy: this rank's own master weights
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
    state["t"] += 1  # every step counted, the skipped ones too
    padded = torch.zeros(N * S, dtype=flat_grad.dtype, device=flat_grad.device)
    padded[: len(flat_grad)] = flat_grad  # [N*S]: zeros after the Psi real gradients
    grad = torch.empty(S, dtype=flat_grad.dtype, device=flat_grad.device)
    comm.reduce_scatter_tensor(grad, padded)  # [S] the sum over ranks of my slice of their gradients
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
    adam_step(state["master"], grad, state["m"], state["v"], state["t"], lr)  # Adam on my shard only
    comm.all_gather_into_tensor(padded, state["master"])  # every rank's new shard, side by side: [N*S]
    flat_param.copy_(padded[: len(flat_param)])  # in place: the model's parameters are views of flat_param
    return True
