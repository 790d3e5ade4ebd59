# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the cap handled
# by shortening 1F1B's warm-up to k - 1 forwards, then alternating strictly. It is complete, never holds more than k
# and does not deadlock, but a rank that must run its next forward before its next backward waits for an input while
# a gradient it could use is already there: at p = 4, m = 8, k = 2 the step takes 69 units instead of 51.
# EXPECT FAIL: capped

# ANSWER: capped
def capped_orders(p, m, k):
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, k - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        orders.append(actions)
    return orders
