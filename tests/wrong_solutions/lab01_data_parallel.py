# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: lesson 01's average, the sum over ranks divided by P. With 3, 3 and 2 rows the mean of the
# ranks' means is not the mean over the rows: the two rows of the last rank weigh as much as three elsewhere. The
# bytes are right; the gradients are not.
# EXPECT FAIL: average

# ANSWER: average
def average_gradients(model: torch.nn.Module, rows: int, batch_rows: int) -> None:
    P = dist.get_world_size()
    for p in model.parameters():
        comm.all_reduce(p.grad)
        p.grad /= P
