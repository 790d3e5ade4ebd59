# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the busiest
# rank's bytes counted for the plainest choice of writers, the first holder of each shared box (rank 0 then writes
# every gain and both K/V heads it shares with rank 1 in each block), not for the choice that makes the busiest
# rank lightest: spread, the shared boxes leave the busiest rank 608 elements lighter.
# EXPECT FAIL: checkpoint_cost

# PREDICT: checkpoint_cost
M = 4
hd, F, V, H, L = CFG.head_size, CFG.ffn, CFG.vocab_size, CFG.hidden, CFG.layers
own = 2 * (V // M) * H + L * (2 * (CFG.heads // M) * hd * H + 3 * (F // M) * H)
kv = 2 * L * hd * H  # rank 0's K/V head, of k and v, in every block
gains = (2 * L + 1) * H
busiest_bytes = 3 * 8 * (own + kv + gains)
mtbf = 50_000 * 3600 / 4096
tau = math.sqrt(2 * 6 * mtbf)
tau_minutes = tau / 60
lost_percent = 100 * (6 / tau + (tau / 2 + 6 + 120 + 300) / mtbf)
