# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 1's weighting
# fixed (each micro-batch's summed loss over the batch's count of real targets), but the gradients all-reduced after
# every micro-batch, as if accumulation needed it. The gradients are right (a sum of sums), but every step sends M
# copies of them instead of one: the bytes each rank communicates catch it.
# EXPECT FAIL: dp_tokens

# ANSWER: train_step
def train_step(model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, M: int) -> None:
    real = (y_r != IGNORE).sum().to(torch.float64)
    comm.all_reduce(real)
    for x_m, y_m in zip(x_r.chunk(M), y_r.chunk(M)):
        before = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        logits = model(x_m)
        loss = F.cross_entropy(logits.flatten(0, 1), y_m.flatten(), ignore_index=IGNORE, reduction="sum") / real
        loss.backward()
        for p, old in zip(model.parameters(), before):
            mine = p.grad - (old if old is not None else 0)
            comm.all_reduce(mine)
            p.grad = mine + (old if old is not None else 0)
