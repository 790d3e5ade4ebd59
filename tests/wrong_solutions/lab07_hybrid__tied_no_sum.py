# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: a tied head's
# copy on the last stage held and counted, but its sum with the first stage's copy left out of the bytes sent (as
# if the copies stayed equal by themselves): the first and the last stage of a tied pipeline send less than the
# theory, and the sent of a plan with pp = 2 is short.
# EXPECT FAIL: plan

# ANSWER: plan
def plan(cfg, world: int, budget: float) -> dict | None:
    """The best plan of `world` ranks for the lab model `cfg` (parlab.core.lab_model.LabConfig, tied or not) when
    a rank may hold `budget` bytes of model states: {"axes": {"dp": D, "pp": S, "tp": T}, "zero": z,
    "microbatches": m, "held": bytes, "sent": bytes, "bubble": fraction}, or None when none is allowed."""
    from parlab.core.mesh import mesh_coords

    H, F, V, hd, nq, nkv, e = (
        cfg.hidden,
        cfg.ffn,
        cfg.vocab_size,
        cfg.head_size,
        cfg.heads,
        cfg.kv_heads,
        cfg.dtype_bytes,
    )

    def kv_heads_of(t, T):  # the K/V heads tp place t of T holds: every one its query heads read
        return range(t * nq // T * nkv // nq, ((t + 1) * nq // T - 1) * nkv // nq + 1)

    def numel(axes, rank):  # the numbers a rank holds of the model (its parameters; as many gradients)
        c = mesh_coords(rank, axes)
        s, S, t, T = c["pp"], axes["pp"], c["tp"], axes["tp"]
        q_rows, kv_rows = nq // T * hd, len(kv_heads_of(t, T)) * hd
        block = 2 * H + 2 * q_rows * H + 2 * kv_rows * H + 3 * F // T * H  # gains; q, o; k, v; gate, up, down
        n = cfg.layers // S * block
        n += (s == 0) * V // T * H  # the embedding's rows
        n += (s == S - 1) * (H + (not cfg.tied or S > 1) * V // T * H)  # final norm; the head (or the tied copy)
        return n

    def held(axes, rank, zero):  # parameters, gradients, Adam's three: ZeRO shares out 3, then +1, then +1 of them
        D = axes["dp"]
        return (
            numel(axes, rank)
            * e
            * (3 / (D if zero >= 1 else 1) + 1 / (D if zero >= 2 else 1) + 1 / (D if zero >= 3 else 1))
        )

    def sent(axes, rank, zero):
        c = mesh_coords(rank, axes)
        s, S, t, T, D = c["pp"], axes["pp"], c["tp"], axes["tp"], axes["dp"]
        blocks, message = cfg.layers // S, B // D * cfg.seq_len * H * e  # one [b, T, H]
        ring = lambda n: 2 * (n - 1) / n  # an all-reduce's bytes sent per byte of payload
        out = 4 * blocks * ring(T) * message + ((s < S - 1) + (s > 0)) * message  # f, g; the pipeline
        for j in kv_heads_of(t, T):  # a K/V head shared with the places whose query heads also read it
            holders = sum(j in kv_heads_of(u, T) for u in range(T))
            out += blocks * 2 * ring(holders) * hd * H * e
        return out + (3 if zero == 3 else 2) * (D - 1) / D * numel(axes, rank) * e  # RS + AG; ZeRO 3: AG twice

    found = []
    for tp in (t for t in range(1, world + 1) if world % t == 0 and nq % t == 0 and F % t == 0 and V % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if world // tp % p == 0 and cfg.layers % p == 0):
            dp = world // (tp * pp)
            if B % dp:
                continue
            m = B // dp  # the most micro-batches (one row each): the least bubble, and the bytes do not change
            bubble = (pp - 1) / (m + pp - 1)
            if bubble > 0.25:
                continue
            axes = {"dp": dp, "pp": pp, "tp": tp}
            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                most_held = max(held(axes, r, zero) for r in range(world))
                most_sent = max(sent(axes, r, zero) for r in range(world))
                if most_held <= budget:
                    found.append((round(most_sent, 6), most_held, axes, zero, m, bubble, most_sent))
    if not found:
        return None
    _, most_held, axes, zero, m, bubble, most_sent = min(found, key=lambda p: p[:2])
    return {"axes": axes, "zero": zero, "microbatches": m, "held": most_held, "sent": most_sent, "bubble": bubble}
