# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (issue 40): f's
# backward all-reduces the gradient autograd handed it, in place, and returns it. dL/dx comes out right, but the
# tensor belonged to autograd, which may have handed it to other nodes too (a residual branch, a hook, another
# consumer of the same gradient): they now see a sum over ranks they never asked for. The check looks at it after
# the backward. The MLP and the attention built on this f still get the right numbers: only the conjugates fail
# (the sequence-parallel pair is right).
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


def gather_tokens(x, layout):
    return GatherTokens.apply(x, layout)


def scatter_tokens(partial, layout):
    return ScatterTokens.apply(partial, layout)


def token_slots(layout):
    longest = max(len(tokens) for tokens in layout)
    token = [t for tokens in layout for t in tokens]
    slot = [r * longest + i for r, tokens in enumerate(layout) for i in range(len(tokens))]
    return longest, token, slot


def all_gather_tokens(x, layout):
    longest, token, slot = token_slots(layout)
    B, n, H = x.shape
    mine = x.new_zeros(longest, B, H)
    mine[:n] = x.transpose(0, 1)
    blocks = x.new_empty(len(layout) * longest, B, H)
    comm.all_gather_into_tensor(blocks, mine)
    whole = x.new_empty(len(token), B, H)
    whole[token] = blocks[slot]
    return whole.transpose(0, 1).contiguous()


def reduce_scatter_tokens(z, layout):
    longest, token, slot = token_slots(layout)
    B, _, H = z.shape
    blocks = z.new_zeros(len(layout) * longest, B, H)
    blocks[slot] = z.transpose(0, 1)[token]
    mine = z.new_empty(longest, B, H)
    comm.reduce_scatter_tensor(mine, blocks)
    return mine[: len(layout[dist.get_rank()])].transpose(0, 1).contiguous()


class GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return all_gather_tokens(x, layout)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_tokens(grad, ctx.layout), None


class ScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, layout):
        ctx.layout = layout
        return reduce_scatter_tokens(partial, layout)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_tokens(grad, ctx.layout), None
