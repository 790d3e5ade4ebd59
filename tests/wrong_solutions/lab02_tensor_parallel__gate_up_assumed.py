# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (the easy
# route): the resharding across degrees is right, but every file is read as Megatron writes it, [gate; up], whatever
# the checkpoint's metadata says. The checkpoint written by 3 ranks comes out right; the interleaved one written by
# 8 ranks does not: in each file rank 0's "gate" rows are the gate and up rows of the first half of its units.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, ckpt, down, enter, leave):
    r, ranks = dist.get_rank(), dist.get_world_size()
    F_, saved = down.shape[1], ckpt.meta["saved_ranks"]
    per_file = F_ // saved
    units = range(r * F_ // ranks, (r + 1) * F_ // ranks)
    gates, ups = [], []
    for file in range(saved):
        place = [u - file * per_file for u in units if u // per_file == file]
        if not place:
            continue
        block = ckpt.read(file, place + [i + per_file for i in place])
        gates.append(block[: len(place)])
        ups.append(block[len(place) :])
    w_gate, w_up = torch.cat(gates), torch.cat(ups)
    h = enter(x)
    a = F.silu(h @ w_gate.T) * (h @ w_up.T)
    return leave(a @ down[:, units.start : units.stop].T)
