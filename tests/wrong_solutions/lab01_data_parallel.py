# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: the gradients are summed over ranks but not divided by P, so every rank would step P times
# too far. The bytes are right; the gradients are not.
# EXPECT FAIL: average

# ANSWER: average
def average_gradients(model: torch.nn.Module) -> None:
    for p in model.parameters():
        comm.all_reduce(p.grad)
