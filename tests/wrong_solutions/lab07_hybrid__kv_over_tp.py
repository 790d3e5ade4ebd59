# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the copies of a K/V
# head are taken to be the whole tp group, so their gradients are summed over tp when tp > kv_heads. With 4 tp
# ranks and 2 K/V heads the sum mixes the two heads' gradients, and the K/V group carries nothing.
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
    shared = mesh.size("tp") > CFG.kv_heads
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
        if shared:  # "the ranks that hold a copy": taken to be the tp group
            for name in ("k", "v"):
                comm.all_reduce(w[name].grad, group=mesh.group("tp"))
        for piece in w.values():
            comm.all_reduce(piece.grad, group=mesh.group("dp"))
            piece.grad /= D
    return loss
