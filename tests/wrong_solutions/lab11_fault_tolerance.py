# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: after each failure the survivors start over instead of loading the checkpoint. They
# keep the global batch, so they reach the same parameters: the work done before each failure is thrown away, and
# the check sees a relaunch from step 0.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once):
    from parlab.runtime.errors import RankError

    alive = machines
    while True:
        world = max(w for w in range(1, alive + 1) if batch % w == 0)
        rows = batch // world
        micro = min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)
        try:
            return launch_run(world, False, rows, micro)
        except RankError:
            alive -= 1
            if alive == 0:
                raise
