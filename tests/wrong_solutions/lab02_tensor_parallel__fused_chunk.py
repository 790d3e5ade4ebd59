# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the files, one
# after another, are cut into P contiguous blocks of rows, as a column-parallel layer's weight is, and each block is
# split in half into "gate" and "up". Where 3 ranks wrote [gate; up] files (32 rows each), rank 0's block is file 0's
# first 24 rows: it pairs gate units 0-11 with gate units 12-15 and up units 0-7; where 8 ranks wrote interleaved
# files, its "gate" half is units 0-5's gate and up rows. The rows read and the traffic are right, the units are not.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, ckpt, down, enter, leave):
    r, ranks = dist.get_rank(), dist.get_world_size()
    saved, per_file = ckpt.meta["saved_ranks"], ckpt.meta["file_shape"][0]
    per_rank = saved * per_file // ranks
    wanted = range(r * per_rank, (r + 1) * per_rank)  # rows of the files laid end to end
    parts = []
    for file in range(saved):
        rows = [i - file * per_file for i in wanted if i // per_file == file]
        if rows:
            parts.append(ckpt.read(file, rows))
    w_gate, w_up = torch.cat(parts).chunk(2)
    k = down.shape[1] // ranks
    h = enter(x)
    a = F.silu(h @ w_gate.T) * (h @ w_up.T)
    return leave(a @ down[:, r * k : (r + 1) * k].T)
