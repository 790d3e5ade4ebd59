# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the window in
# which a failure finds the newest checkpoint incomplete taken as the write alone, 120 s from the start of the
# pause, where the write starts when the pause ends: the checkpoint is complete 126 s after its pause began. The
# interval is right (that window does not depend on it), the time lost 0.5% too small.
# EXPECT FAIL: checkpoint_cost

# PREDICT: checkpoint_cost
M = 4
hd, F, V, H, L = CFG.head_size, CFG.ffn, CFG.vocab_size, CFG.hidden, CFG.layers
own = 2 * (V // M) * H + L * (2 * (CFG.heads // M) * hd * H + 3 * (F // M) * H)
kv = 2 * L * CFG.kv_heads // M * hd * H
gains = math.ceil((2 * L + 1) / M) * H
busiest_bytes = 3 * 8 * (own + kv + gains)
mtbf = 50_000 * 3600 / 4096
tau = math.sqrt(2 * 6 * mtbf)
tau_minutes = tau / 60
lost_percent = 100 * (6 / tau + (tau / 2 + 120 + 300) / mtbf)
