# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the loss scaled as
# the global batch's mean (each replica backpropagates loss / D and the dp all-reduce sums without dividing) where
# the handout asks for DDP's convention (each replica's own loss, the gradients averaged). Every piece's gradient,
# the loss and every byte are right; x.grad on the first stage is D times too small.
# EXPECT FAIL: step

# ANSWER: step
def kv_groups(tp_ranks: list[int], heads: int, kv_heads: int) -> dict[int, list[int]]:
    """{K/V head j: the ranks of the tp group `tp_ranks` (global, in tp order) that hold a copy of it, in tp order}
    for a model of `heads` query heads on `kv_heads` K/V heads (a helper: the checks do not call it)."""
    T = len(tp_ranks)
    holders = {j: [] for j in range(kv_heads)}
    for t, rank in enumerate(tp_ranks):
        first, last = t * heads // T, (t + 1) * heads // T - 1  # its query heads
        for j in range(first * kv_heads // heads, last * kv_heads // heads + 1):  # the K/V heads they read
            holders[j].append(rank)
    return holders


def tp_block(h: torch.Tensor, w: dict, mesh, positions: torch.Tensor) -> torch.Tensor:
    """One lab-model block (parlab.core.lab_model.LabBlock) on this rank's pieces `w` (its query heads, the K/V
    heads they read, its FFN rows). h: [b, T, H], the same on every rank of the tp group; positions: [T], the
    tokens' positions; mesh: parlab's DeviceMesh (mesh.index("tp"), mesh.size("tp"), mesh.group("tp")). Returns
    [b, T, H], the same on every rank of the tp group."""
    b, T, H = h.shape
    hd, nq, nkv = CFG.head_size, CFG.heads, CFG.kv_heads
    place, places, tp_group = mesh.index("tp"), mesh.size("tp"), mesh.group("tp")
    mine = range(place * nq // places, (place + 1) * nq // places)  # my query heads
    first_kv = mine[0] * nkv // nq  # the first K/V head I hold
    kv_of = torch.tensor([hq * nkv // nq - first_kv for hq in mine], device=h.device)  # local K/V head of each

    def heads(t):  # [b, T, n*hd] -> [b, n, T, hd]
        return t.view(b, T, -1, hd).transpose(1, 2)

    a = f(rms_norm(h, w["attn_norm"], CFG.eps), tp_group)  # [b, T, H], identity forward
    q = apply_rope(heads(a @ w["q"].T), positions, CFG.rope_base)  # [b, nq/T, T, hd]: my query heads
    k = apply_rope(heads(a @ w["k"].T), positions, CFG.rope_base)[:, kv_of]  # [b, nq/T, T, hd]: each one's K
    v = heads(a @ w["v"].T)[:, kv_of]  # its V (the pairing is not uniform: gqa_attention's own would be wrong)
    y = gqa_attention(q, k, v)  # [b, nq/T, T, hd]
    h = h + g(y.transpose(1, 2).reshape(b, T, -1) @ w["o"].T, tp_group)  # my heads' share of o, summed
    m = f(rms_norm(h, w["mlp_norm"], CFG.eps), tp_group)
    return h + g((F.silu(m @ w["gate"].T) * (m @ w["up"].T)) @ w["down"].T, tp_group)  # [b, T, H]


def hybrid_step(mesh, blocks: list[dict], x: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """One training step of this rank. mesh: parlab's DeviceMesh (mesh.group(axis), mesh.ranks(axis),
    mesh.index(axis), mesh.size(axis), mesh.axes, mesh.rank, mesh.torch_mesh.mesh). blocks: this rank's pieces of
    its stage's blocks, [{"q": ..., ...}, ...]. x, target: [B, T, H], the global batch (the same on every rank).
    Afterwards each piece's .grad must be the whole batch's gradient of it, and x.grad (first stage) the gradient
    of this replica's loss in its rows, 0 elsewhere. Returns the loss of this rank's replica (the mean over its
    rows) on the last stage, None elsewhere."""
    s, S = mesh.index("pp"), mesh.size("pp")
    d, D = mesh.index("dp"), mesh.size("dp")
    pp_ranks, pp_group = mesh.ranks("pp"), mesh.group("pp")  # my replica's TP-slice-t ranks, stage by stage
    hd, nq, nkv, places = CFG.head_size, CFG.heads, CFG.kv_heads, mesh.size("tp")
    # Every tp group of the mesh, and in each every K/V head held by more than one rank: a group for it. Every
    # rank creates every group, in the same order (collective); I keep those of my K/V heads.
    grid = mesh.torch_mesh.mesh
    tp_groups = grid.movedim(list(mesh.axes).index("tp"), -1).reshape(-1, places).tolist()
    shared = {}  # my K/V head j -> the group of its holders
    for ranks in tp_groups:
        for j, holders in kv_groups(ranks, nq, nkv).items():
            if len(holders) > 1:
                group = dist.new_group(holders)
                if mesh.rank in holders:
                    shared[j] = group
    place = mesh.index("tp")
    first_kv = place * nq // places * nkv // nq
    b = x.shape[0] // D
    rows = slice(d * b, (d + 1) * b)  # my replica's rows: [b, T, H]
    positions = torch.arange(x.shape[1], device=x.device)
    if s == 0:
        h_in = x[rows]
    else:  # the previous stage's output, and a leaf whose gradient goes back to it
        h_in = torch.empty(b, *x.shape[1:], dtype=x.dtype, device=x.device)
        comm.recv(h_in, pp_ranks[s - 1], group=pp_group)
        h_in.requires_grad_()
    h = h_in
    for w in blocks:
        h = tp_block(h, w, mesh, positions)
    loss = None
    if s == S - 1:
        loss = loss_fn(h, target[rows])
        (loss / D).backward()  # the global mean's scale: each replica's share of the whole batch's loss
    else:
        comm.send(h.detach(), pp_ranks[s + 1], group=pp_group)
        grad = torch.empty_like(h)  # dL/dh from the next stage
        comm.recv(grad, pp_ranks[s + 1], group=pp_group)
        h.backward(grad)
    if s > 0:
        comm.send(h_in.grad, pp_ranks[s - 1], group=pp_group)
    for w in blocks:
        for j, group in sorted(shared.items()):  # a copy's gradient holds only what my query heads sent back
            local = slice((j - first_kv) * hd, (j - first_kv + 1) * hd)  # head j's rows in my k and v
            for name in ("k", "v"):
                comm.all_reduce(w[name].grad[local], group=group)
        for piece in w.values():  # the replicas' mean, within my dp group (same stage, same slice)
            comm.all_reduce(piece.grad, group=mesh.group("dp"))  # shares of the mean: their sum is the mean
    return loss
    # END SOLUTION
