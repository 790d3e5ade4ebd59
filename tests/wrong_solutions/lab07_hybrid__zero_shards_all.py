# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: ZeRO stage 1 taken
# to divide every kind of state by the dp size (that is stage 3), so parameters and gradients come out D times
# too small; the prediction at scale makes the same mistake (all 16 bytes per parameter over 16).
# EXPECT FAIL: memory, memory_at_scale

# ANSWER: memory
def local_shapes(cfg, axes, rank):
    from parlab.core.mesh import mesh_coords

    c = mesh_coords(rank, axes)
    s, S, T = c["pp"], axes["pp"], axes["tp"]
    H, F, V, hd = cfg.hidden, cfg.ffn, cfg.vocab_size, cfg.head_size
    q_rows, kv_rows = cfg.heads // T * hd, max(cfg.kv_heads // T, 1) * hd
    shapes = {"embed.weight": (V // T, H)} if s == 0 else {}
    per = cfg.layers // S
    for i in range(s * per, (s + 1) * per):
        p = f"blocks.{i}."
        shapes |= {
            p + "attn_norm.weight": (H,),
            p + "attn.q.weight": (q_rows, H),
            p + "attn.k.weight": (kv_rows, H),
            p + "attn.v.weight": (kv_rows, H),
            p + "attn.o.weight": (H, q_rows),
            p + "mlp_norm.weight": (H,),
            p + "mlp.gate.weight": (F // T, H),
            p + "mlp.up.weight": (F // T, H),
            p + "mlp.down.weight": (H, F // T),
        }
    if s == S - 1:
        shapes |= {"norm.weight": (H,), "head.weight": (V // T, H)}
    return shapes


def state_bytes(cfg, axes, rank):
    psi = sum(math.prod(shape) for shape in local_shapes(cfg, axes, rank).values())
    e, D = cfg.dtype_bytes, axes["dp"]
    return {"params": psi * e // D, "grads": psi * e // D, "optimizer": 3 * psi * e // D}


# PREDICT: memory_at_scale
H, F, V, hd, T = 8192, 28672, 128256, 128, 8
block = 2 * H + 2 * (64 // T * hd) * H + 2 * hd * H + 3 * (F // T) * H
psi = 80 // 8 * block + V // T * H + H
gb = psi * (2 + 2 + 12) / 16 / 1e9
