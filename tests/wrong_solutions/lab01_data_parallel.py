# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the mean over rows, part 1's weighting before this lab was about tokens:
# each rank's mean over its own real tokens, weighted by its share of the batch's ROWS (the row count travels
# in the one all-reduce; a rank without real tokens is given a zero gradient, so nothing is NaN). The
# communication is exactly right; the gradients and the loss are not the mean over the batch's real tokens.
# EXPECT FAIL: average

# ANSWER: average
def token_step(model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, mask_r: torch.Tensor) -> float:
    logits = model(x_r)
    if mask_r.any():
        loss = F.cross_entropy(logits[mask_r], y_r[mask_r])  # the mean over this rank's real tokens
    else:
        loss = logits.sum() * 0.0  # no real token: a zero gradient
    loss.backward()
    rows = float(len(x_r))
    params = list(model.parameters())
    flat = torch.cat(
        [p.grad.reshape(-1) * rows for p in params] + [torch.stack([loss.detach() * rows, loss.new_tensor(rows)])]
    )
    comm.all_reduce(flat)
    flat /= flat[-1].item()  # / B, the batch's rows
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat[-2].item()
