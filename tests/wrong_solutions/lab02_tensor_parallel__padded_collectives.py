# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (the
# library's way): the library's pair of collectives (an all-gather and a reduce-scatter along the sequence, as
# parlab.schemes.sequence does them, written out) with each rank's tokens padded to the largest count and a
# token-to-slot index to put them in order. Every number is exact and part 3 runs on it, but the collectives are not
# ring messages, and the padding travels: a rank receives more than the tokens it lacks.
# EXPECT FAIL: conjugates

# ANSWER: conjugates
def gather_tokens(x, layout):
    return GatherTokens.apply(x, layout)


def scatter_tokens(partial, layout):
    return ScatterTokens.apply(partial, layout)


def token_slots(layout):
    longest = max(len(tokens) for tokens in layout)
    token = [t for tokens in layout for t in tokens]  # the sequence index of each token held, rank by rank
    slot = [r * longest + i for r, tokens in enumerate(layout) for i in range(len(tokens))]  # its row in the blocks
    return longest, token, slot


def all_gather_tokens(x, layout):
    longest, token, slot = token_slots(layout)
    B, n, H = x.shape
    mine = x.new_zeros(longest, B, H)  # this rank's block, zero padded to the largest count
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
