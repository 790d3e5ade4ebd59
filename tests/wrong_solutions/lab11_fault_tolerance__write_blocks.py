# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the
# checkpoint priced as if its write blocked training (Young's interval with the pause and the write, 126 s, as the
# cost of a checkpoint), and a failure before the checkpoint is complete not counted. The interval comes out 4.6
# times too long and the time lost too large; the bytes are right.
# EXPECT FAIL: checkpoint_cost

# PREDICT: checkpoint_cost
busiest_bytes = 3 * 8 * (2 * 16 * 32 + 2 * (2 * 8 * 32 + 3 * 16 * 32) + 2 * 8 * 32 + 2 * 32)
mtbf = 50_000 * 3600 / 4096
tau = math.sqrt(2 * (6 + 120) * mtbf)
tau_minutes = tau / 60
lost_percent = 100 * ((6 + 120) / tau + (tau / 2 + 300) / mtbf)
