# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the gradients are
# averaged over every rank (the default group, divided by the world size), as in plain data parallelism, instead
# of over the rank's dp group. The shapes agree on one mesh and not on the other: it sums pieces of other stages
# and other TP slices, and its dp group carries nothing, so the measured traffic on dp is not the theory's.
# EXPECT FAIL: step, traffic

# ANSWER: step
def tp_block(h, w, tp_group, positions):
    b, T, H = h.shape
    hd = CFG.head_size

    def heads(t):
        return t.view(b, T, -1, hd).transpose(1, 2)

    a = f(rms_norm(h, w["attn_norm"], CFG.eps), tp_group)
    q = apply_rope(heads(a @ w["q"].T), positions, CFG.rope_base)
    k = apply_rope(heads(a @ w["k"].T), positions, CFG.rope_base)
    y = gqa_attention(q, k, heads(a @ w["v"].T))
    h = h + g(y.transpose(1, 2).reshape(b, T, -1) @ w["o"].T, tp_group)
    m = f(rms_norm(h, w["mlp_norm"], CFG.eps), tp_group)
    return h + g((F.silu(m @ w["gate"].T) * (m @ w["up"].T)) @ w["down"].T, tp_group)


def hybrid_step(mesh, blocks, x, target):
    s, S = mesh.index("pp"), mesh.size("pp")
    d, D = mesh.index("dp"), mesh.size("dp")
    pp_ranks, pp_group = mesh.ranks("pp"), mesh.group("pp")
    world = math.prod(mesh.axes.values())
    kv_groups = sorted({tuple(kv_group(r, mesh.axes, CFG.heads, CFG.kv_heads)) for r in range(world)})
    kv, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in kv_groups])
    shared = len(kv_group(mesh.rank, mesh.axes, CFG.heads, CFG.kv_heads)) > 1
    b = x.shape[0] // D
    rows = slice(d * b, (d + 1) * b)
    positions = torch.arange(x.shape[1], device=x.device)
    if s == 0:
        h_in = x[rows]
    else:
        h_in = torch.empty(b, *x.shape[1:], dtype=x.dtype, device=x.device)
        comm.recv(h_in, pp_ranks[s - 1], group=pp_group)
        h_in.requires_grad_()
    h = h_in
    for w in blocks:
        h = tp_block(h, w, mesh.group("tp"), positions)
    loss = None
    if s == S - 1:
        loss = loss_fn(h, target[rows])
        loss.backward()
    else:
        comm.send(h.detach(), pp_ranks[s + 1], group=pp_group)
        grad = torch.empty_like(h)
        comm.recv(grad, pp_ranks[s + 1], group=pp_group)
        h.backward(grad)
    if s > 0:
        comm.send(h_in.grad, pp_ranks[s - 1], group=pp_group)
    for w in blocks:
        if shared:
            for name in ("k", "v"):
                comm.all_reduce(w[name].grad, group=kv)
        for piece in w.values():
            comm.all_reduce(piece.grad)  # every rank, as in plain data parallelism
            piece.grad /= world
    return loss
