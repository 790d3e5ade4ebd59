# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: g is made
# "symmetric": its backward all-reduces the gradient too, as f's does. Every rank already holds the same dL/dy, so
# the sum is P times too large, and the MLP and the attention built on g get gradients P times too large below g,
# with one extra all-reduce in their backward.
# EXPECT FAIL: conjugates, swiglu, gqa

# ANSWER: conjugates
class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        comm.all_reduce(total)
        return total


class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        out = partial.clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        comm.all_reduce(total)
        return total


def f(x):
    return CopyToParallel.apply(x)


def g(partial):
    return ReduceFromParallel.apply(partial)
