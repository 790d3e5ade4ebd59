# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: the row-parallel layer's weight gradient is computed as x_r^T grad_y, [k, out], the
# transpose of the weight's shape [out, k]. The forward is right; in the backward, autograd rejects the gradient on
# the ranks, so the check fails with the failing rank's error.
# EXPECT FAIL: row_parallel

# ANSWER: row_parallel
class RowParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_r, w_r):
        ctx.save_for_backward(x_r, w_r)
        y = x_r @ w_r.T
        comm.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_r, w_r = ctx.saved_tensors
        grad_x = grad_y @ w_r
        grad_w = x_r.flatten(0, -2).T @ grad_y.flatten(0, -2)
        return grad_x, grad_w
