# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# counts a token's own rank among its destinations (rows a rank sends itself never travel), so every shift seems to
# carry a message (shift 0 among them: ranks that are multiples of 4 keep tokens home).
# EXPECT FAIL: rounds

# PREDICT: rounds
P, E = 64, 128
kinds = [[(2 * s, 2 * s + 1)] + [(5, 69)] * (s >= 48) + [(s, s + 64)] * (s % 4 == 0) for s in range(P)]
sends = [[any(d in (a % P, b % P) for a, b in kinds[s]) for d in range(P)] for s in range(P)]
rounds_fewest = max([sum(sends[s]) for s in range(P)] + [sum(sends[s][d] for s in range(P)) for d in range(P)])
rounds_shifted = sum(any(sends[s][(s + k) % P] for s in range(P)) for k in range(0, P))
