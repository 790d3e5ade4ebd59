# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the fused
# gate_up checkpoint is cut into P contiguous blocks, as a column-parallel layer's weight is, and each block split in
# half into "gate" and "up". Where the saving run had 2 ranks, rank 0 then pairs gate units 0-3 with gate units 4-7
# and rank 2 up units with up units; where it had 8, each block holds two files, [gate; up; gate; up], and the halves
# pair the first file's gates with its own ups but the second file's gates too. The traffic is right, the units not.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, gate_up, down, saved_ranks, enter, leave):
    r, ranks = dist.get_rank(), dist.get_world_size()
    w_gate, w_up = gate_up.chunk(ranks)[r].chunk(2)
    k = down.shape[1] // ranks
    h = enter(x)
    a = F.silu(h @ w_gate.T) * (h @ w_up.T)
    return leave(a @ down[:, r * k : (r + 1) * k].T)
