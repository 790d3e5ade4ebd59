# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: any error is taken for a machine's death, and nothing stops the relaunches: a launch
# that fails before any rank starts is retried on 3, 3, 2, 1, 1, 1 ... ranks, for ever (no machine left still
# plans one rank). The check stops it after 8 launches (a FAIL line that says so) instead of the cell running until
# its timeout.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once):
    alive, resume = machines, False
    while True:
        world = max([w for w in range(1, alive + 1) if batch % w == 0], default=1)
        rows = batch // world
        micro = min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)
        try:
            return launch_run(world, resume, rows, micro)
        except Exception:
            alive, resume = alive - 1, True
