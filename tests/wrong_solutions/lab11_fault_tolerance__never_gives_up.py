# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: any error is taken for a machine's death, and nothing stops the relaunches: a bug in a
# rank, a launch that fails before any rank starts, and the death of the last machine are all retried, for ever (no
# machine left still plans one rank). The check stops each after 8 launches (a FAIL line that says so) instead of
# the cell running until its timeout.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once, micro_batch_cost):
    def plan(alive):
        best = None
        for world in range(1, max(alive, 1) + 1):
            if batch % world == 0:
                rows = batch // world
                micro = min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)
                cost = rows + micro * micro_batch_cost
                if best is None or cost < best[0]:
                    best = (cost, world, rows, micro)
        return best[1:]

    alive, resume = machines, False
    while True:
        world, rows, micro = plan(alive)
        try:
            return launch_run(world, resume, rows, micro)
        except Exception:
            alive, resume = alive - 1, True
