# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: part 2's P-times-too-large gradients "fixed" by dividing by P after the backward's all-reduce of g. Every
# number now matches one device, but the backward still all-reduces twice (g's and f's): a collective that sums
# what is already the same on every rank, then undoes it. The bytes in backward catch it.
# EXPECT FAIL: tp_backward

# ANSWER: megatron_f_g
class Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad


class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        y = partial.clone()
        comm.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad / comm.group_size()
