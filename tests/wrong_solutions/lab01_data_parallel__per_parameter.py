# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the right sums, sent one tensor at a time: the loss sum and the token count
# in one all-reduce, then one all-reduce per parameter (21 calls a step, each paying a collective's latency). The
# bytes are one copy of the gradients and two numbers, as asked; the calls are not one.
# EXPECT FAIL: average

# ANSWER: average
def token_step(model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, mask_r: torch.Tensor) -> float:
    logits = model(x_r)
    loss_sum = F.cross_entropy(logits[mask_r], y_r[mask_r], reduction="sum")
    loss_sum.backward()
    sums = torch.stack([loss_sum.detach(), mask_r.sum().to(loss_sum.dtype)])
    comm.all_reduce(sums)  # the batch's loss sum and its real tokens
    for p in model.parameters():
        comm.all_reduce(p.grad)
        p.grad /= sums[1]
    return (sums[0] / sums[1]).item()
