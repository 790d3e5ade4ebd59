# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_labs.py grades it; the other answers are the
# solution's). The bug: the gradients are summed over ranks but not divided by P, so every rank steps P times too
# far. The bytes are right; the gradients and the trained parameters are not.
# EXPECT FAIL: average, training

# ANSWER: average
def average_gradients(model: torch.nn.Module) -> None:
    for p in model.parameters():
        comm.all_reduce(p.grad)
