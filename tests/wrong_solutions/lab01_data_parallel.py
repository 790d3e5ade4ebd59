# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the mean over the real tokens (the library's sum-then-divide, with the token count travelling in
# the one all-reduce). Right communication, no NaN on the rank without tokens, but long documents weigh more than
# short ones: the loss is not the mean of the documents' means.
# EXPECT FAIL: average

# ANSWER: average
def token_step(
    model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, doc_r: torch.Tensor, doc_len_r: torch.Tensor
) -> float:
    mask = doc_r >= 0
    loss_sum = F.cross_entropy(model(x_r)[mask], y_r[mask], reduction="sum")
    loss_sum.backward()
    params = list(model.parameters())
    sums = torch.stack([loss_sum.detach(), mask.sum().to(loss_sum.dtype)])
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [sums])
    comm.all_reduce(flat)
    flat /= flat[-1].item()  # / N, the batch's real tokens
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat[-2].item()
