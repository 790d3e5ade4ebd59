# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: every rank
# writes what it holds. The boxes are right, but a K/V head held by several ranks (M above the K/V heads) and the
# RMSNorm gains held by all are written several times: the checkpoint holds them twice or more.
# EXPECT FAIL: tp_layout

# ANSWER: tp_layout
def tp_layout(name, shape, cfg, M, r):
    if len(shape) == 1:
        return ((0, shape[0]),), True
    R, C = shape
    kind = name.split(".")[-2]
    hd, per = cfg.head_size, cfg.heads // M
    if kind == "q":
        return ((r * per * hd, (r + 1) * per * hd), (0, C)), True
    if kind == "o":
        return ((0, R), (r * per * hd, (r + 1) * per * hd)), True
    if kind in ("k", "v"):
        group = cfg.heads // cfg.kv_heads
        first, last = r * per // group, ((r + 1) * per - 1) // group
        return ((first * hd, (last + 1) * hd), (0, C)), True
    if kind == "down":
        return ((0, R), (r * C // M, (r + 1) * C // M)), True
    return ((r * R // M, (r + 1) * R // M), (0, C)), True
