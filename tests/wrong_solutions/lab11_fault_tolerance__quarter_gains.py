# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the RMSNorm
# gains cut in M pieces like the rest, each rank writing a quarter of each. A gain is held whole by every rank and,
# as a box, written whole by one of them: the 5 gains spread over 4 ranks leave one rank with two. The quarter
# counts 40 elements of gains where the busiest writes 64: 576 bytes too few out of 136 thousand (0.4%), which an
# exact check sees.
# EXPECT FAIL: checkpoint_cost

# PREDICT: checkpoint_cost
M = 4
hd, F, V, H, L = CFG.head_size, CFG.ffn, CFG.vocab_size, CFG.hidden, CFG.layers
own = 2 * (V // M) * H + L * (2 * (CFG.heads // M) * hd * H + 3 * (F // M) * H)
kv = 2 * L * CFG.kv_heads // M * hd * H
gains = (2 * L + 1) * H // M
busiest_bytes = 3 * 8 * (own + kv + gains)
mtbf = 50_000 * 3600 / 4096
tau = math.sqrt(2 * 6 * mtbf)
tau_minutes = tau / 60
lost_percent = 100 * (6 / tau + (tau / 2 + 6 + 120 + 300) / mtbf)
