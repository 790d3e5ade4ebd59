# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: the micro-batches counted as ceil(rows / rows_at_once), as if they could be unequal. On
# 3 ranks (6 rows, 3 micro-batches of 2) that is right; on 2 ranks each has 9 rows, and 5 micro-batches of 9 rows
# are not equal: the harness refuses the launch, and its ValueError reaches the caller, rightly unhandled.
# EXPECT FAIL: survive

# ANSWER: survive
import math


def survive(launch_run, machines, batch, rows_at_once):
    from parlab.runtime.errors import RankError

    alive, resume = machines, False
    while True:
        world = max(w for w in range(1, alive + 1) if batch % w == 0)
        rows = batch // world
        try:
            return launch_run(world, resume, rows, math.ceil(rows / rows_at_once))
        except RankError:
            alive, resume = alive - 1, True
            if alive == 0:
                raise
