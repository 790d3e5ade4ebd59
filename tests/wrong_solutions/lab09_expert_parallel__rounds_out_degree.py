# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# takes the fewest rounds as the most messages one rank sends, forgetting that a rank receives one message a round
# too: rank 3 receives token rows from three ranks.
# EXPECT FAIL: rounds

# PREDICT: rounds
P, E = 6, 12
routing = checks.ROUTING
sends = [[d != s and any(d in (a % P, b % P) for a, b, _ in routing[s]) for d in range(P)] for s in range(P)]
rounds_fewest = max(sum(sends[s]) for s in range(P))
rounds_shifted = sum(any(sends[s][(s + k) % P] for s in range(P)) for k in range(1, P))
