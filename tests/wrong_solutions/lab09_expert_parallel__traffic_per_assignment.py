# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# counts one row per assignment, as lesson 09's layer sends, not one per (token, destination): a token whose two
# experts share a rank is counted twice, out and back, under both placements.
# EXPECT FAIL: traffic

# PREDICT: traffic
P, E = 4, 8
pairs = checks.TRAFFIC_PAIRS
per = E // P
rows_round_robin = sum(n * ((a % P != 0) + (b % P != 0)) for a, b, n in pairs[0])
rows_round_robin += sum(n * ((a % P == 0) + (b % P == 0)) for s in range(1, P) for a, b, n in pairs[s])
rows_contiguous = sum(n * ((a // per != 0) + (b // per != 0)) for a, b, n in pairs[0])
rows_contiguous += sum(n * ((a // per == 0) + (b // per == 0)) for s in range(1, P) for a, b, n in pairs[s])
