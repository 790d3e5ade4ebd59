# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: k and v cut over tp
# like q, n_kv h_d / T rows each, also when tp > n_kv: with 4 tp ranks and 2 K/V heads a rank would hold half a
# head. A rank holds whole K/V heads: the one its query heads read, a copy of it on each rank that shares it.
# At scale (tp 8 = 8 K/V heads) the two agree, so only the small layouts catch it.
# EXPECT FAIL: memory

# ANSWER: memory
def local_shapes(cfg, axes, rank):
    from parlab.core.mesh import mesh_coords

    c = mesh_coords(rank, axes)
    s, S, T = c["pp"], axes["pp"], axes["tp"]
    H, F, V, hd = cfg.hidden, cfg.ffn, cfg.vocab_size, cfg.head_size
    q_rows, kv_rows = cfg.heads * hd // T, cfg.kv_heads * hd // T
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
    e = cfg.dtype_bytes
    return {"params": psi * e, "grads": psi * e, "optimizer": 3 * psi * e // axes["dp"]}
