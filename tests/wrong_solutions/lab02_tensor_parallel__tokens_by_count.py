# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the layout is
# read for its counts only, as if every rank held neighbouring tokens (rank 0 the first n_0, rank 1 the next n_1...):
# padding, blocks and both collectives are right, and the contiguous layout comes out right, but on the striped and
# scattered layouts the "sequence" is in rank order. The MLP does not notice (it treats every token alike, and the
# scatter puts each token back where the gather took it from); attention does: its causal mask and positions see the
# tokens out of order.
# EXPECT FAIL: conjugates, gqa

# ANSWER: conjugates
def gather_tokens(x, layout):
    return GatherTokens.apply(x, layout)


def scatter_tokens(partial, layout):
    return ScatterTokens.apply(partial, layout)


def token_slots(layout):
    longest = max(len(tokens) for tokens in layout)
    token = list(range(sum(len(tokens) for tokens in layout)))  # rank 0's first, then rank 1's, ...
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
