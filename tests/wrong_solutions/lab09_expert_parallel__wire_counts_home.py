# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb. The bug: the prediction counts every row rank 0 hands to the
# forward all-to-alls as leaving it, also the rows for its own experts (0 and 4) and their results, which never
# leave the rank. The payload is right; the wire bytes are 2 x 11 rows too many.
# EXPECT FAIL: traffic

# PREDICT: traffic
P, E, H = 4, 8, 6
counts = checks.TRAFFIC_COUNTS
S = sum(counts[0])
R = sum(counts[s][e] for s in range(P) for e in [0, 4])
payload_rank0 = 8 * E + 2 * (S + R) * H * 8
wire_rank0 = (S + R) * H * 8
