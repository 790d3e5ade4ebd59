# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: Adam's step count t
# goes up in every step, the skipped ones too. Every rank skips the right steps and the traffic is right, but from
# step 3 on Adam's bias correction uses t = 3 where one device, whose optimizer never saw the skipped step, uses 2:
# the parameters and m differ after step 3.
# EXPECT FAIL: zero1

# ANSWER: zero1
def init_shard(flat_param: torch.Tensor) -> dict:
    """This rank's optimizer state: "master" (its shard of flat_param [Psi]), "m" and "v", [S] each, and whatever
    else your steps need (the check counts the bytes of its tensors, single numbers aside)."""
    N, r = comm.group_size(), comm.group_rank()
    S = math.ceil(len(flat_param) / N)  # the shard size; the last rank's shard ends in the padding
    padded = torch.zeros(N * S, dtype=flat_param.dtype, device=flat_param.device)
    padded[: len(flat_param)] = flat_param
    master = padded[r * S : (r + 1) * S].clone()  # [S] a copy: this rank's own master weights
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
    padded = torch.zeros(N * S, dtype=flat_grad.dtype, device=flat_grad.device)
    padded[: len(flat_grad)] = flat_grad  # [N*S]: zeros after the Psi real gradients
    grad = torch.empty(S, dtype=flat_grad.dtype, device=flat_grad.device)
    comm.reduce_scatter_tensor(grad, padded)  # [S] the sum over ranks of my slice of their gradients
    grad /= N  # the mean over ranks: my slice of the whole batch's gradient
    # ||g||^2 is the sum over ranks of their shards' sums of squares; an inf or a NaN anywhere makes it one too
    squares = grad.pow(2).sum().reshape(1)  # [1]
    comm.all_reduce(squares)  # every rank: the same number, so every rank takes the same decision
    norm = math.sqrt(squares.item()) if math.isfinite(squares.item()) else math.nan
    state["t"] += 1  # every step counted, the skipped ones too
    if not math.isfinite(norm):
        return False  # skipped: Adam never sees this step, and the parameters do not change
    grad *= min(1.0, max_norm / (norm + 1e-6))  # clip_grad_norm_'s factor, for the whole gradient
    adam_step(state["master"], grad, state["m"], state["v"], state["t"], lr)  # Adam on my shard only
    comm.all_gather_into_tensor(padded, state["master"])  # every rank's new shard, side by side: [N*S]
    flat_param.copy_(padded[: len(flat_param)])  # in place: the model's parameters are views of flat_param
    return True
