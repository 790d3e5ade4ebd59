# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 1 fixed (the
# global count of real targets), but the gradients averaged with the library's naive data parallelism,
# parlab.schemes.data_parallel.all_reduce_gradients, the loss scaled by P to undo its division. The gradients and
# the traffic are right, but the fix is a call into the library's implementation of the scheme the bug is about:
# the check sees the call and names it.
# EXPECT FAIL: dp_tokens

# ANSWER: train_step
from parlab.schemes.data_parallel import all_reduce_gradients


def train_step(model, x_r, y_r, M):
    real = (y_r != IGNORE).sum().to(torch.float64)
    comm.all_reduce(real)
    for x_m, y_m in zip(x_r.chunk(M), y_r.chunk(M)):
        logits = model(x_m)
        loss = F.cross_entropy(logits.flatten(0, 1), y_m.flatten(), ignore_index=IGNORE, reduction="sum")
        (loss * comm.group_size() / real).backward()
    all_reduce_gradients(model)
