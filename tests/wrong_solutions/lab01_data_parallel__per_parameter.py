# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the right sums, sent one tensor at a time: the weighted loss sum and D in one all-reduce,
# then one all-reduce per parameter (21 calls a step, each paying a collective's latency). The bytes are one copy of
# the gradients and two numbers, as asked; the calls are not one.
# EXPECT FAIL: average

# ANSWER: average
def token_step(
    model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, doc_r: torch.Tensor, doc_len_r: torch.Tensor
) -> float:
    mask = doc_r >= 0
    ce = F.cross_entropy(model(x_r)[mask], y_r[mask], reduction="none")
    share = 1.0 / doc_len_r[mask].to(ce.dtype)
    weighted = (ce * share).sum()
    weighted.backward()
    sums = torch.stack([weighted.detach(), share.sum()])
    comm.all_reduce(sums)  # the batch's weighted loss sum and D
    for p in model.parameters():
        comm.all_reduce(p.grad)
        p.grad /= sums[1]
    return (sums[0] / sums[1]).item()
