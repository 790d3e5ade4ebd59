# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 1 half fixed the
# other way. The count is now of the real targets (y != IGNORE), so PAD appearing in the documents no longer
# matters; but it is still each rank's own count, and the ranks' means are averaged: the ranks hold different numbers
# of real targets, and the mean of their means is not the mean over the batch (a rank with few real targets weighs
# as much as one with many).
# EXPECT FAIL: dp_tokens

# ANSWER: train_step
def train_step(model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, M: int) -> None:
    P = comm.group_size()
    real = (y_r != IGNORE).sum()
    for x_m, y_m in zip(x_r.chunk(M), y_r.chunk(M)):
        logits = model(x_m)
        loss = F.cross_entropy(logits.flatten(0, 1), y_m.flatten(), ignore_index=IGNORE, reduction="sum") / real
        loss.backward()
    for p in model.parameters():
        comm.all_reduce(p.grad)
        p.grad /= P
