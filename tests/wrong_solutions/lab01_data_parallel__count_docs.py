# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: each token weighted by 1/n_d, right, but D is counted as the documents each rank sees
# (torch.unique of its ids), all-reduced in the one collective. A document cut between ranks is counted once by each
# rank holding part of it: in step 1 document 1 lies on ranks 0 and 1 (D = 6 instead of 5), in step 2 document 1
# on all three. Every rank agrees, nothing is NaN, and the loss is too small.
# EXPECT FAIL: average

# ANSWER: average
def token_step(
    model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, doc_r: torch.Tensor, doc_len_r: torch.Tensor
) -> float:
    mask = doc_r >= 0
    ce = F.cross_entropy(model(x_r)[mask], y_r[mask], reduction="none")
    weighted = (ce / doc_len_r[mask].to(ce.dtype)).sum()
    weighted.backward()
    params = list(model.parameters())
    seen = float(len(torch.unique(doc_r[mask])))  # the documents this rank sees
    sums = torch.stack([weighted.detach(), weighted.new_tensor(seen)])
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [sums])
    comm.all_reduce(flat)
    flat /= flat[-1].item()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat[-2].item()
