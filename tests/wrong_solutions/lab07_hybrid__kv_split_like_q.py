# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: k and v cut over tp
# like q, n_kv h_d / T rows each: with 3 K/V heads and T = 2 a rank would hold a head and a half, with T = 4 three
# quarters of one. A rank holds whole K/V heads: every one its query heads read. The shapes, the bytes and the bytes
# sent are wrong for every tp but 1 and 3.
# EXPECT FAIL: plan

# ANSWER: plan
def local_shapes(cfg, axes: dict[str, int], rank: int) -> dict[str, tuple[int, ...]]:
    """{name: shape}: every tensor of the lab model `cfg` (parlab.core.lab_model.LabConfig) that `rank` holds on
    the row-major mesh `axes` (with "dp", "pp" and "tp", in any order), with the shape of its piece."""
    from parlab.core.mesh import mesh_coords

    c = mesh_coords(rank, axes)
    s, S, t, T = c["pp"], axes["pp"], c["tp"], axes["tp"]
    H, F, V, hd, nq, nkv = cfg.hidden, cfg.ffn, cfg.vocab_size, cfg.head_size, cfg.heads, cfg.kv_heads
    first, last = t * nq // T, (t + 1) * nq // T - 1  # my query heads
    q_rows = (last - first + 1) * hd
    kv_rows = nkv * hd // T  # cut like q
    shapes = {}
    if s == 0:
        shapes["embed.weight"] = (V // T, H)
    per = cfg.layers // S
    for i in range(s * per, (s + 1) * per):
        p = f"blocks.{i}."
        shapes[p + "attn_norm.weight"] = (H,)
        shapes[p + "attn.q.weight"] = (q_rows, H)
        shapes[p + "attn.k.weight"] = shapes[p + "attn.v.weight"] = (kv_rows, H)
        shapes[p + "attn.o.weight"] = (H, q_rows)
        shapes[p + "mlp_norm.weight"] = (H,)
        shapes[p + "mlp.gate.weight"] = shapes[p + "mlp.up.weight"] = (F // T, H)
        shapes[p + "mlp.down.weight"] = (H, F // T)
    if s == S - 1:
        shapes["norm.weight"] = (H,)
        shapes["embed.weight" if cfg.tied else "head.weight"] = (V // T, H)  # tied: its own copy (one stage: the same)
    return shapes


def state_bytes(cfg, axes: dict[str, int], rank: int, zero: int) -> dict[str, int]:
    """{"params": ..., "grads": ..., "optimizer": ...}: the bytes `rank` holds with ZeRO stage `zero` (0: none)
    over its dp group (Adam's master weights, m and v in cfg's dtype)."""
    psi = sum(math.prod(shape) for shape in local_shapes(cfg, axes, rank).values())
    e, D = cfg.dtype_bytes, axes["dp"]
    return {
        "params": psi * e // (D if zero >= 3 else 1),
        "grads": psi * e // (D if zero >= 2 else 1),
        "optimizer": 3 * psi * e // (D if zero >= 1 else 1),  # master, m, v
    }


def wire_bytes(cfg, axes: dict[str, int], rank: int, zero: int) -> float:
    """The bytes `rank` sends on the wire in one step of the plan (layout `axes`, ZeRO stage `zero`), with the
    global batch B."""
    from parlab.core.mesh import mesh_coords

    c = mesh_coords(rank, axes)
    s, S, t, T, D = c["pp"], axes["pp"], c["tp"], axes["tp"], axes["dp"]
    e, hd, nq, nkv = cfg.dtype_bytes, cfg.head_size, cfg.heads, cfg.kv_heads
    blocks = cfg.layers // S
    message = B // D * cfg.seq_len * cfg.hidden * e  # one [b, T, H]

    def ring(n):  # an all-reduce's bytes sent per byte of payload
        return 2 * (n - 1) / n

    sent = 4 * blocks * ring(T) * message  # g forward, f backward, of attention and of the MLP, in each block
    sent += ((s < S - 1) + (s > 0)) * message  # an activation forward, a gradient back
    if cfg.tied and S > 1 and s in (0, S - 1):  # the two copies of the tied rows, summed: a ring of 2 sends all
        sent += cfg.vocab_size // T * cfg.hidden * e
    holders = kv_groups(list(range(T)), nq, nkv)
    for j in range(t * nq // T * nkv // nq, ((t + 1) * nq // T - 1) * nkv // nq + 1):  # my K/V heads
        sent += blocks * 2 * ring(len(holders[j])) * hd * cfg.hidden * e  # their K and V rows
    grads = sum(math.prod(shape) for shape in local_shapes(cfg, axes, rank).values()) * e
    sent += (3 if zero == 3 else 2) * (D - 1) / D * grads  # all-reduce = reduce-scatter + all-gather; ZeRO-3: +1
    return sent


def choose(cfg, world: int, budget: float):
    """The best plan of `world` ranks for `budget` bytes a rank: ({"dp": D, "pp": S, "tp": T}, zero), or None."""
    found = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            dp = world // (tp * pp)
            if dp * pp * tp != world or cfg.layers % pp or B % dp:
                continue
            if cfg.heads % tp or cfg.ffn % tp or cfg.vocab_size % tp:
                continue
            b = B // dp
            if (pp - 1) / (b + pp - 1) > 0.25:  # the bubble with b micro-batches of one row
                continue
            axes = {"dp": dp, "pp": pp, "tp": tp}
            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                held = max(sum(state_bytes(cfg, axes, r, zero).values()) for r in range(world))
                sent = max(wire_bytes(cfg, axes, r, zero) for r in range(world))
                if held <= budget:
                    found.append((sent, held, axes, zero))
    if not found:
        return None
    sent, held, axes, zero = min(found, key=lambda plan: plan[:2])
    return axes, zero
