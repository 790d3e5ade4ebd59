# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (issue 40): f's
# backward all-reduces the gradient autograd handed it, in place, and returns it. dL/dx comes out right, but the
# tensor belonged to autograd, which may have handed it to other nodes too (a residual branch, a hook, another
# consumer of the same gradient): they now see a sum over ranks they never asked for. The check looks at it after
# the backward. The MLP and the attention built on this f still get the right numbers: only the conjugates fail.
# EXPECT FAIL: conjugates

# ANSWER: conjugates
class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        comm.all_reduce(grad)  # in place, on autograd's tensor
        return grad


class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        out = partial.clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


def f(x):
    return CopyToParallel.apply(x)


def g(partial):
    return ReduceFromParallel.apply(partial)
