# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 3's padding fixed,
# but the block's positions numbered 0..2c-1, as if the block were a sequence of its own. Every block has the right
# size, yet RoPE turns each rank's tokens by the wrong angles: q k^T no longer depends on the tokens' true distance,
# and the attention differs from one device's at both lengths (rank 0's first chunk is the only one that is right).
# EXPECT FAIL: zigzag_padding

# ANSWER: zigzag_shard
def zigzag_shard(x, rank, P):
    T = x.shape[-2]
    c = math.ceil(T / (2 * P))
    x = F.pad(x, (0, 0, 0, 2 * P * c - T))
    chunks = [rank, 2 * P - 1 - rank]
    block = torch.cat([x[..., i * c : (i + 1) * c, :] for i in chunks], dim=-2)
    return block, torch.arange(2 * c, device=x.device)
