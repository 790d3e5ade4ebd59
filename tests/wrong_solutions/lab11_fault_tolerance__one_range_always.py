# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the fewest
# reads taken for the fastest whatever the latency: one range from the box's first element to its last. The
# crossover is right, but at 20 microseconds a read (below it) the 8,192 reads of one row each cost 164 ms of latency
# and save 205 ms of other ranks' columns: row by row is faster.
# EXPECT FAIL: checkpoint_cost

# PREDICT: checkpoint_cost
rows, cols, nbytes, bandwidth = 8192, 28672, 2, 2e9
width = cols // 8
gap = (cols - width) * nbytes
crossover_us = gap / bandwidth * 1e6
latency = 20e-6
by_row = rows * latency + rows * width * nbytes / bandwidth
one_range = latency + (rows * width * nbytes + (rows - 1) * gap) / bandwidth
best_ms = one_range * 1e3
mtbf = 50_000 * 3600 / 4096
tau = math.sqrt(2 * 6 * mtbf)
tau_minutes = tau / 60
lost_percent = 100 * (6 / tau + (tau / 2 + 6 + 120 + 300) / mtbf)
