# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: any error is taken for a machine's death. The failures are survived as they should be,
# but a launch that fails before any rank starts (a bad argument: every machine is alive) is retried on fewer and
# fewer machines, from a checkpoint, instead of reaching the caller.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once):
    alive, resume = machines, False
    while alive > 0:
        world = max(w for w in range(1, alive + 1) if batch % w == 0)
        rows = batch // world
        micro = min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)
        try:
            return launch_run(world, resume, rows, micro)
        except Exception:
            alive, resume = alive - 1, True
