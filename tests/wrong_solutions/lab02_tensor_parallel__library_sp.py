# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the
# sequence-parallel pair calls the library's Megatron-SP operators (parlab.schemes.sequence.sequence_parallel) on
# padded blocks and lets autograd undo the padding and the order: the numbers are right, but the all-gather and the
# reduce-scatter with their backwards are the library's, not the student's (and they are collectives carrying
# padding, not ring messages of real tokens). Every part that runs the pair fails on the line naming the call (part
# 2 does not use the pair).
# EXPECT FAIL: conjugates, gqa

# ANSWER: conjugates
from parlab.schemes.sequence.sequence_parallel import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel


def token_slots(layout):
    longest = max(len(tokens) for tokens in layout)
    token = [t for tokens in layout for t in tokens]
    slot = [r * longest + i for r, tokens in enumerate(layout) for i in range(len(tokens))]
    return longest, token, slot


def gather_tokens(x, layout):
    longest, token, slot = token_slots(layout)
    B, n, H = x.shape
    padded = torch.cat([x, x.new_zeros(B, longest - n, H)], dim=1)
    blocks = gather_from_sequence_parallel(padded)  # [B, P longest, H], rank order
    order = [0] * len(token)
    for t, s in zip(token, slot):
        order[t] = s
    return blocks[:, order]


def scatter_tokens(partial, layout):
    longest, token, slot = token_slots(layout)
    B, T, H = partial.shape
    where = torch.tensor(slot, device=partial.device)
    blocks = partial.new_zeros(B, len(layout) * longest, H).index_copy(1, where, partial[:, token])
    mine = reduce_scatter_to_sequence_parallel(blocks)  # [B, longest, H]
    return mine[:, : len(layout[dist.get_rank()])]
