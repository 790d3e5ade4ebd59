# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the sum of squares is
# taken of the SCALED gradient shard and unscaled afterwards (divided by scale^2), to save a division. Every step
# with ordinary gradients is right, and so are the overflowed ones; but in step 6 a rank's scaled gradient holds a
# finite 1e156, whose square overflows float64: the rank takes it for an overflow and skips a step that one device,
# which unscales first (GradScaler's unscale_ before clip_grad_norm_), takes with a finite norm.
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
    padded = torch.zeros(N * S, dtype=flat_grad.dtype, device=flat_grad.device)
    padded[: len(flat_grad)] = flat_grad  # [N*S]: zeros after the Psi real gradients
    grad = torch.empty(S, dtype=flat_grad.dtype, device=flat_grad.device)
    comm.reduce_scatter_tensor(grad, padded)  # [S] the sum over ranks of my slice of their gradients
    grad /= N  # the mean over ranks, still scaled
    squares = grad.pow(2).sum().reshape(1)  # [1] of the scaled gradient: one division by scale^2 saved
    comm.all_reduce(squares)  # every rank: the same number, so every rank takes the same decision
    squares /= state["scale"] ** 2  # the unscaled gradient's ||g||^2
    grad /= state["scale"]
    if not math.isfinite(squares.item()):
        state["scale"], state["in_a_row"] = state["scale"] / 2, 0  # GradScaler's backoff
        return False  # skipped: Adam never sees this step, and the parameters do not change
    state["in_a_row"] += 1
    if state["in_a_row"] == GROWTH:  # GradScaler's growth: the scale doubles after GROWTH good steps in a row
        state["scale"], state["in_a_row"] = state["scale"] * 2, 0
    grad *= min(1.0, max_norm / (math.sqrt(squares.item()) + 1e-6))  # clip_grad_norm_'s factor, whole gradient
    state["t"] += 1
    adam_step(state["master"], grad, state["m"], state["v"], state["t"], lr)  # Adam on my shard only
    comm.all_gather_into_tensor(padded, state["master"])  # every rank's new shard, side by side: [N*S]
    flat_param.copy_(padded[: len(flat_param)])  # in place: the model's parameters are views of flat_param
    return True
