# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (the easy
# route): every rank reads every file whole, builds the fused [2F, H] gate_up and takes its units' rows from it. The
# numbers, the units and the traffic are right, but each rank held the whole checkpoint (96 rows read where its
# units have 24): at a real model's size that does not fit in one rank's memory.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, ckpt, down, enter, leave):
    r, ranks = dist.get_rank(), dist.get_world_size()
    F_, saved = down.shape[1], ckpt.meta["saved_ranks"]
    gate_up = torch.cat([ckpt.read(file, slice(None)) for file in range(saved)])  # [2F, H]
    per_file = F_ // saved
    units = torch.arange(r * F_ // ranks, (r + 1) * F_ // ranks, device=x.device)
    first = units // per_file * 2 * per_file  # the first row of the unit's file
    place = units % per_file
    if ckpt.meta["fused"] == "[gate; up]":
        gate_rows, up_rows = first + place, first + place + per_file
    else:
        gate_rows, up_rows = first + 2 * place, first + 2 * place + 1
    w_gate, w_up = gate_up[gate_rows], gate_up[up_rows]
    h = enter(x)
    a = F.silu(h @ w_gate.T) * (h @ w_up.T)
    return leave(a @ down[:, units].T)
