# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: part 1 half fixed. The count of real tokens is now the whole batch's (all-reduced, and the gradients
# summed, not averaged), so a rank with few real tokens no longer weighs as much as one with many; but it still
# counts the inputs that are not PAD, and PAD (token 0) is also a real token of the documents: the count is short
# of the real targets one device divides by, and every gradient comes out a little too large.
# EXPECT FAIL: dp_tokens

# ANSWER: train_step
def train_step(model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, M: int) -> None:
    real = (x_r != PAD).sum().to(torch.float64)
    comm.all_reduce(real)
    for x_m, y_m in zip(x_r.chunk(M), y_r.chunk(M)):
        logits = model(x_m)
        loss = F.cross_entropy(logits.flatten(0, 1), y_m.flatten(), ignore_index=IGNORE, reduction="sum") / real
        loss.backward()
    for p in model.parameters():
        comm.all_reduce(p.grad)
