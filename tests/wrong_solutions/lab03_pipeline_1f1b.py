# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the cap ignored,
# 1F1B written out (warm-up of p - 1 - r forwards, then one forward and one backward, then the backwards owed). It
# is complete, deadlock-free and reaches the least bubble where k = p, but rank 0 holds p micro-batches at its peak:
# every case with k < p fails on the micro-batches in flight.
# EXPECT FAIL: capped

# ANSWER: capped
def capped_orders(p, m, k):
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        orders.append(actions)
    return orders
