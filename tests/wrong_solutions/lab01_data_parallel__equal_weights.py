# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: each micro-batch's loss is divided by M, as if the micro-batches had the same size. With
# b = 5 rows in micro-batches of 2, 2 and 1, the single row of the last one weighs as much as two rows elsewhere:
# the gradient is not the mean over the batch. The communication is exactly right.
# EXPECT FAIL: training

# ANSWER: accumulation
def accumulation_step(model: torch.nn.Module, dp: OverlappedDP, x_r: torch.Tensor, y_r: torch.Tensor, M: int) -> float:
    loss_of_rows = 0.0
    for m, (x_m, y_m) in enumerate(zip(x_r.tensor_split(M), y_r.tensor_split(M), strict=True)):
        dp.sync = m == M - 1
        loss = lab_loss(model(x_m), y_m) / M
        loss.backward()
        loss_of_rows += loss.item()
    dp.finish()
    return loss_of_rows
