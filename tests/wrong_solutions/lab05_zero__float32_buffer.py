# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the gradient shard is
# torch.empty(S), float32 by default, while the model and its gradients are float64. gloo would abort the
# reduce-scatter from C++ ("Check failed: outputTensors[i].dtype() == inputTensors[i].dtype()"); the check refuses it
# first, on the rank, with a sentence naming both dtypes, and that sentence is the reason the grader reports.
# EXPECT FAIL: zero1

# ANSWER: zero1
def init_shard(flat_param: torch.Tensor) -> dict[str, torch.Tensor]:
    N, r = comm.group_size(), comm.group_rank()
    S = math.ceil(len(flat_param) / N)
    padded = torch.zeros(N * S, dtype=flat_param.dtype)
    padded[: len(flat_param)] = flat_param
    master = padded[r * S : (r + 1) * S].clone()
    return {"master": master, "m": torch.zeros_like(master), "v": torch.zeros_like(master)}


def zero1_step(flat_param: torch.Tensor, flat_grad: torch.Tensor, state: dict, step: int, lr: float = LR) -> None:
    N = comm.group_size()
    S = len(state["master"])
    padded = torch.zeros(N * S, dtype=flat_grad.dtype)
    padded[: len(flat_grad)] = flat_grad
    grad = torch.empty(S)
    comm.reduce_scatter_tensor(grad, padded)
    grad /= N
    adam_step(state["master"], grad, state["m"], state["v"], step, lr)
    comm.all_gather_into_tensor(padded, state["master"])
    flat_param.copy_(padded[: len(flat_param)])
