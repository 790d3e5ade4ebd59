# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (the easy
# route): Megatron-SP's way, with part 1's own pair: the whole sequence gathered in, this rank's units on every
# token, the partial sums reduce-scattered out. y is exact, the units are split and the pair's messages go one way
# round the ring, but the whole sequence [B, T, H] sits on every rank (over the memory bound), and no transfer
# hides behind a GEMM.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, gate, up, down, layout):
    r, ranks = dist.get_rank(), dist.get_world_size()
    mine = slice(r * gate.shape[0] // ranks, (r + 1) * gate.shape[0] // ranks)
    h = gather_tokens(x, layout)  # [B, T, H]
    a = F.silu(h @ gate[mine].T) * (h @ up[mine].T)
    return scatter_tokens(a @ down[:, mine].T, layout)
