# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# counts the rows rank 0 sends itself as leaving it: every token of rank 0 goes out once to each rank of its experts,
# rank 0 included, and rank 0's results for its own tokens are counted as sent back. Those rows never leave the rank.
# EXPECT FAIL: traffic

# PREDICT: traffic
P, E = 4, 8
pairs = checks.TRAFFIC_PAIRS
per = E // P
rows_round_robin = sum(n * (1 + (a % P != b % P)) for a, b, n in pairs[0])
rows_round_robin += sum(n * (a % P == 0 or b % P == 0) for s in range(P) for a, b, n in pairs[s])
rows_contiguous = sum(n * (1 + (a // per != b // per)) for a, b, n in pairs[0])
rows_contiguous += sum(n * (a // per == 0 or b // per == 0) for s in range(P) for a, b, n in pairs[s])
