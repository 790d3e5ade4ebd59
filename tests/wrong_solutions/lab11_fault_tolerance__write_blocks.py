# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the
# checkpoint priced as if its write blocked training (Young's interval with the pause and the write, 126 s, as the
# cost of a checkpoint), and a failure before the checkpoint is complete not counted. The interval comes out 4.6
# times too long and the time lost too large; the reads are right.
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
tau = math.sqrt(2 * (6 + 120) * mtbf)
tau_minutes = tau / 60
lost_percent = 100 * ((6 + 120) / tau + (tau / 2 + 300) / mtbf)
