# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 1 "fixed" with the
# library's naive data parallelism, parlab.schemes.data_parallel.all_reduce_gradients, called once after the last
# micro-batch. The gradients and the traffic are right, but the fix is a call into the library's implementation of
# the scheme the bug is about: the check sees the call and names it.
# EXPECT FAIL: dp_accumulation

# ANSWER: train_step
from parlab.schemes.data_parallel import all_reduce_gradients


def train_step(model, x_r, y_r, M):
    for x_m, y_m in zip(x_r.chunk(M), y_r.chunk(M)):
        (lab_loss(model(x_m), y_m) / M).backward()
    all_reduce_gradients(model)
