# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: the micro-batches are weighted right, but dp.sync is never turned off, so the hooks start
# the bucket all-reduces in the first backward already: they carry the first micro-batch's gradients only, and
# finish() writes those back over the accumulated ones.
# EXPECT FAIL: training

# ANSWER: accumulation
def accumulation_step(model: torch.nn.Module, dp: OverlappedDP, x_r: torch.Tensor, y_r: torch.Tensor, M: int) -> float:
    b, loss_of_rows = len(x_r), 0.0
    for x_m, y_m in zip(x_r.tensor_split(M), y_r.tensor_split(M), strict=True):
        loss = lab_loss(model(x_m), y_m) * (len(x_m) / b)
        loss.backward()
        loss_of_rows += loss.item()
    dp.finish()
    return loss_of_rows
