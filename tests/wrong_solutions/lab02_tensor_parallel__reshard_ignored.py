# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the fused
# checkpoint is read as if one rank had written it, [gate; up] of all F units (gate's rows 0..F-1, up's F..2F-1), and
# saved_ranks is ignored. With 2 saving ranks, rows F.. are the second file's gates and ups, not up's rows: rank 0's
# "up" units are the second file's gates. Each rank still reads one gate row, one up row and one down column per
# unit, in the same places, so the traffic is right; the units are not.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, gate_up, down, saved_ranks, enter, leave):
    r, ranks = dist.get_rank(), dist.get_world_size()
    F_ = down.shape[1]
    units = slice(r * F_ // ranks, (r + 1) * F_ // ranks)
    w_gate, w_up = gate_up[:F_][units], gate_up[F_:][units]
    h = enter(x)
    a = F.silu(h @ w_gate.T) * (h @ w_up.T)
    return leave(a @ down[:, units].T)
