# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: after a failure the next launch plans on one rank fewer than the last launch had, not on
# the machines still alive. The first launch leaves the fourth machine out (18 rows do not split over 4); when one of
# its 3 ranks dies, 3 machines are still alive, but this relaunches on 2 (9 rows each, slower), and ends on 1.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once):
    from parlab.runtime.errors import RankError

    alive, resume = machines, False
    while True:
        world = max(w for w in range(1, alive + 1) if batch % w == 0)
        rows = batch // world
        micro = min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)
        try:
            return launch_run(world, resume, rows, micro)
        except RankError:
            alive, resume = world - 1, True
            if alive == 0:
                raise
