# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: ZeRO stage 1 taken
# to divide every kind of state by the dp size (that is stage 3), so parameters and gradients come out D times
# too small; the prediction at scale makes the same mistake (16 bytes per parameter over 16).
# EXPECT FAIL: memory, memory_at_scale

# ANSWER: memory
def state_bytes(cfg, axes: dict[str, int], rank: int) -> dict[str, int]:
    D, S, T = axes["dp"], axes["pp"], axes["tp"]
    s = mesh_group(rank, axes, "pp").index(rank)
    Hd, Fd, V = cfg.hidden, cfg.ffn, cfg.vocab_size
    split = 4 * Hd * Hd + 3 * Hd + 2 * Hd * Fd + Fd
    replicated = 6 * Hd
    psi = cfg.layers // S * (split // T + replicated)
    if s == 0:
        psi += V * Hd // T + cfg.seq_len * Hd
    if s == S - 1:
        psi += V * Hd // T + 2 * Hd
    e = cfg.dtype_bytes
    return {"params": psi * e // D, "grads": psi * e // D, "optimizer": 3 * psi * e // D}


# ANSWER: memory_at_scale
gb = 175e9 / 64 * (2 + 2 + 12) / 16 / 1e9
