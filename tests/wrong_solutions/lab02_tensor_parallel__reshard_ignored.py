# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the checkpoint
# is read as if one rank had written it, [gate; up] of all F units (gate's rows 0..F-1, up's F..2F-1, over the files
# laid end to end), and saved_ranks is ignored. With 2 saving ranks, rows F.. are the second file's gates and ups,
# not up's rows: rank 0's "up" units are the second file's gates. Each rank still reads 2F/P rows and one down column
# per unit, so the reads and the traffic are right; the units are not.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, ckpt, down, enter, leave):
    r, ranks = dist.get_rank(), dist.get_world_size()
    F_, per_file = down.shape[1], ckpt.meta["file_shape"][0]
    units = list(range(r * F_ // ranks, (r + 1) * F_ // ranks))
    rows = units + [F_ + u for u in units]  # "gate rows, then up rows" of one fused matrix

    def read(row):
        return ckpt.read(row // per_file, [row % per_file])

    block = torch.cat([read(row) for row in rows])
    w_gate, w_up = block[: len(units)], block[len(units) :]
    h = enter(x)
    a = F.silu(h @ w_gate.T) * (h @ w_up.T)
    return leave(a @ down[:, units].T)
