# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: lesson 11's first-order
# count: Young's interval from the pause, and the loss as the pauses' share plus, per failure, half an interval, the
# write and the restart over the MTBF. The interval is near the best (the loss is flat there), but with failures this
# frequent the first-order loss is far above what the run measures.
# EXPECT FAIL: checkpoint_cost

# ANSWER: checkpoint_cost
def choose_interval(mtbf, pause, write, restart):
    tau = math.sqrt(2 * pause * mtbf)
    return tau, pause / tau + (tau / 2 + write + restart) / mtbf
