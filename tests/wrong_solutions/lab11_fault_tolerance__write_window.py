# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the window in
# which a failure finds the newest checkpoint incomplete taken as the write alone, 120 s from the start of the
# pause, where the write starts when the pause ends: the checkpoint is complete 126 s after its pause began. The
# interval is right (that window does not depend on it), the time lost 0.5% too small.
# EXPECT FAIL: checkpoint_cost

# PREDICT: checkpoint_cost
rows, cols, nbytes, bandwidth = 8192, 28672, 2, 2e9
width = cols // 8
gap = (cols - width) * nbytes
crossover_us = gap / bandwidth * 1e6
latency = 20e-6
by_row = rows * latency + rows * width * nbytes / bandwidth
one_range = latency + (rows * width * nbytes + (rows - 1) * gap) / bandwidth
best_ms = min(by_row, one_range) * 1e3
mtbf = 50_000 * 3600 / 4096
tau = math.sqrt(2 * 6 * mtbf)
tau_minutes = tau / 60
lost_percent = 100 * (6 / tau + (tau / 2 + 120 + 300) / mtbf)
