# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: K and V cut as
# Q is, by an even share of their rows. While M divides the K/V heads that is right; once M exceeds them each rank
# gets part of a head (on M = 4 with 2 K/V heads of 8 rows: 4 rows each), which no attention can use: every query
# head needs a whole K/V head.
# EXPECT FAIL: tp_layout

# ANSWER: tp_layout
def tp_layout(name, shape, cfg, M, r):
    if len(shape) == 1:
        return ((0, shape[0]),), r == 0
    R, C = shape
    kind = name.split(".")[-2]
    if kind in ("o", "down"):
        return ((0, R), (r * C // M, (r + 1) * C // M)), True
    return ((r * R // M, (r + 1) * R // M), (0, C)), True
