# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the plainest
# choice of writers, the first rank that holds each shared box, as parlab's own tensor-parallel checkpoint leaves
# every replicated tensor to rank 0. Every element is written once, but rank 0 writes every gain and, with its
# group's first ranks, every K/V head: on the lab model with M = 4 it writes 608 elements (14,592 bytes) more than
# the busiest rank need.
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

    box = box_of(name, shape, r)
    return box, r == min(q for q in range(M) if box_of(name, shape, q) == box)
