# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the actions are
# placed in time as the ideal timeline runs them, under the cap, but when a rank could start a forward and a
# backward at the same moment it takes the forward. The forward takes the rank's last slot while the backward that
# would free one waits, and with it the rank before, which needs that backward's gradient to free its own slots: at
# p = 4, m = 8, k = 2 the step takes 52 units instead of 51 (and more in every other case with k > 1).
# EXPECT FAIL: capped

# ANSWER: capped
def capped_orders(p, m, k):
    cost = {"F": 1, "B": 2}
    orders = [[] for _ in range(p)]
    free = [0] * p
    ended = {}
    next_f, next_b = [0] * p, [0] * p
    for _ in range(2 * m * p):
        options = []
        for r in range(p):
            i, j = next_b[r], next_f[r]
            if i < j and (r == p - 1 or ("B", i, r + 1) in ended):
                options.append((max(free[r], ended.get(("B", i, r + 1), 0)), 1, r, "B", i))
            if j < m and j - i < k and (r == 0 or ("F", j, r - 1) in ended):
                options.append((max(free[r], ended.get(("F", j, r - 1), 0)), 0, r, "F", j))  # a forward first
        start, _, r, op, mb = min(options)
        ended[(op, mb, r)] = free[r] = start + cost[op]
        orders[r].append((op, mb))
        next_f[r] += op == "F"
        next_b[r] += op == "B"
    return orders
