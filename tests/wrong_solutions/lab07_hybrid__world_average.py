# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the gradients are
# averaged over every rank (the default group, divided by the world size), as in plain data parallelism, instead
# of over the rank's dp group. The shapes agree, so it runs: it sums slices of other stages and other TP slices,
# and its dp axis carries nothing, so the measured traffic on dp is not the theory's.
# EXPECT FAIL: step, traffic

# ANSWER: step
def hybrid_step(mesh, blocks: list, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    s, S = mesh.index("pp"), mesh.size("pp")
    d, D = mesh.index("dp"), mesh.size("dp")
    pp_ranks, pp_group = mesh.ranks("pp"), mesh.group("pp")
    b = x.shape[0] // D
    rows = slice(d * b, (d + 1) * b)
    if s == 0:
        h_in = x[rows]
    else:
        h_in = torch.empty(b, x.shape[1], dtype=x.dtype)
        comm.recv(h_in, pp_ranks[s - 1], group=pp_group)
        h_in.requires_grad_()
    h = h_in
    for w1, w2 in blocks:
        h = mlp_block(h, w1, w2, mesh.group("tp"))
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
    world = comm.group_size()
    for w1, w2 in blocks:
        for w in (w1, w2):
            comm.all_reduce(w.grad)
            w.grad /= world
    return loss
