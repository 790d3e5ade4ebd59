# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 2's partial gain
# gradient "fixed" by summing it over the ranks in backward, the tensor-parallel region still entered before the
# RMSNorm. Every number now matches one device, but the backward makes a second all-reduce (of the gain's H numbers)
# where Megatron's makes one: the bytes communicated in backward catch it.
# EXPECT FAIL: tp_norm

# ANSWER: megatron_mlp
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
        return grad


def mlp_sublayer(x, norm, gate, up, down):
    x_tp = Copy.apply(x)
    n = rms_norm(x_tp, Copy.apply(norm))  # the gain's gradient summed over the ranks
    h = F.silu(n @ gate.T) * (n @ up.T)
    return x + Reduce.apply(h @ down.T)
