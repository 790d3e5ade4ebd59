# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the weighting is right (1/n_d per token, D as the sum of the fractions), but each rank starts
# from its own weighted mean and multiplies it back by its fractions. On a rank with no real token that mean is
# 0/0: NaN, and NaN times 0 is still NaN. The one all-reduce spreads it to every rank.
# EXPECT FAIL: average

# ANSWER: average
def token_step(
    model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, doc_r: torch.Tensor, doc_len_r: torch.Tensor
) -> float:
    mask = doc_r >= 0
    ce = F.cross_entropy(model(x_r)[mask], y_r[mask], reduction="none")
    share = 1.0 / doc_len_r[mask].to(ce.dtype)
    here = share.sum()
    weighted = (ce * share).sum() / here * here  # the rank's weighted mean, times its fractions
    weighted.backward()
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.stack([weighted.detach(), here])])
    comm.all_reduce(flat)
    flat /= flat[-1].item()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat[-2].item()
