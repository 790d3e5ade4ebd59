# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the background write priced
# as a cost per checkpoint, as if it blocked training: the interval chosen for a checkpoint that costs the pause and
# the write. The loss is counted exactly at that interval (so the prediction matches what is measured), but where the
# write is long the interval is far too long: it loses more than the best interval does.
# EXPECT FAIL: checkpoint_cost

# ANSWER: checkpoint_cost
def choose_interval(mtbf, pause, write, restart):
    cost = pause + write
    lo, hi = cost, cost + mtbf
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.exp(mid / mtbf) * (1 - (mid - cost) / mtbf) > 1 else (lo, mid)
    tau = (lo + hi) / 2
    kept = (tau - pause) * math.exp(-write / mtbf) / ((math.exp(tau / mtbf) - 1) * (mtbf + restart))
    return tau, 1 - kept
