# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the weighting is right, by tokens, but each rank starts from the mean over
# its own real tokens and multiplies it by their number. On a rank with no real token that mean is 0/0: NaN,
# and NaN times 0 is still NaN. The one all-reduce spreads it to every rank.
# EXPECT FAIL: average

# ANSWER: average
def token_step(model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, mask_r: torch.Tensor) -> float:
    """One step's gradient, on every rank: forward and backward on this rank's rows, then one all-reduce. On return
    every p.grad is the gradient of the mean cross-entropy over the real tokens of the whole global batch, and the
    result is that mean. x_r, y_r: [b_r, T] token ids; mask_r: [b_r, T], True where y_r's target is a real token."""
    logits = model(x_r)  # [b_r, T, V]
    n_r = mask_r.sum()
    loss_sum = F.cross_entropy(logits[mask_r], y_r[mask_r]) * n_r  # the rank's mean, times its tokens
    loss_sum.backward()
    params = list(model.parameters())
    sums = torch.stack([loss_sum.detach(), n_r.to(loss_sum.dtype)])  # [2]: loss sum, n_r
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [sums])  # [Psi + 2]
    comm.all_reduce(flat)  # sums over ranks: the whole batch's gradient of the loss sum, its loss sum, its N tokens
    tokens = flat[-1].item()  # N = sum over ranks of n_r, known to no rank before
    flat /= tokens  # the mean over the N real tokens
    offset = 0
    for p in params:  # slice [offset, offset + numel) of flat is p's gradient
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat[-2].item()  # the whole batch's loss sum / N
