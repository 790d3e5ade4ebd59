# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# counts a token's own rank among its destinations (rows a rank sends itself never travel), so every shift seems to
# carry a message and the busiest rank looks busier.
# EXPECT FAIL: rounds

# PREDICT: rounds
P, E = 6, 12
routing = checks.ROUTING
sends = [[any(d in (a % P, b % P) for a, b, _ in routing[s]) for d in range(P)] for s in range(P)]
rounds_fewest = max([sum(sends[s]) for s in range(P)] + [sum(sends[s][d] for s in range(P)) for d in range(P)])
rounds_shifted = sum(any(sends[s][(s + k) % P] for s in range(P)) for k in range(0, P))
