# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: f and g are the
# library's own (parlab.schemes.tensor_parallel's copy_to_tensor_parallel and reduce_from_tensor_parallel), imported
# instead of written; the sequence-parallel pair is the student's own. The numbers and the calls are right, and so
# are the MLP's and the attention's, which use f and g in their tensor-parallel cases: every part that runs them fails
# on the line naming the call.
# EXPECT FAIL: conjugates, swiglu, gqa

# ANSWER: conjugates
from parlab.schemes.tensor_parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel


def f(x):
    return copy_to_tensor_parallel(x)


def g(partial):
    return reduce_from_tensor_parallel(partial)


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
