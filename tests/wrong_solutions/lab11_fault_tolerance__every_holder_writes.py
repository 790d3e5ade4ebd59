# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: every rank
# writes what it holds. The boxes are right, but a K/V head held by several ranks (M above the K/V heads) and the
# RMSNorm gains held by all are written several times: the checkpoint holds them twice or more, and the real save
# finds them in several ranks' files.
# EXPECT FAIL: tp_layout

# ANSWER: tp_layout
def tp_layout(name, shape, cfg, M, r):
    def box_of(name, shape, q):
        if len(shape) == 1:
            return ((0, shape[0]),)
        R, C = shape
        kind = name.split(".")[-2]
        hd, per = cfg.head_size, cfg.heads // M
        heads = (q * per * hd, (q + 1) * per * hd)
        if kind == "q":
            return (heads, (0, C))
        if kind == "o":
            return ((0, R), heads)
        if kind in ("k", "v"):
            group = cfg.heads // cfg.kv_heads
            first, last = q * per // group, ((q + 1) * per - 1) // group
            return ((first * hd, (last + 1) * hd), (0, C))
        if kind == "down":
            return ((0, R), (q * C // M, (q + 1) * C // M))
        return ((q * R // M, (q + 1) * R // M), (0, C))

    return box_of(name, shape, r), True
