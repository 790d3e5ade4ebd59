# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# takes the fewest rounds as the most messages one rank sends, forgetting that a rank receives one message a round
# too: the hot rank 5 receives token rows from far more ranks than any rank sends to.
# EXPECT FAIL: rounds

# PREDICT: rounds
P, E = 64, 128
kinds = [[(2 * s, 2 * s + 1)] + [(5, 69)] * (s >= 48) + [(s, s + 64)] * (s % 4 == 0) for s in range(P)]
sends = [[d != s and any(d in (a % P, b % P) for a, b in kinds[s]) for d in range(P)] for s in range(P)]
rounds_fewest = max(sum(sends[s]) for s in range(P))
rounds_shifted = sum(any(sends[s][(s + k) % P] for s in range(P)) for k in range(1, P))
