# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: every RankError taken for a dead machine. The deaths are survived as they should be,
# but when a rank's code raises (a bug: its traceback is a Python one, every machine is alive) the job relaunches on
# fewer and fewer machines, the bug raising each time, until it believes none is left: four launches where the
# first one's error should have reached the caller.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once, micro_batch_cost):
    from parlab.runtime.errors import RankError

    def plan(alive):
        best = None
        for world in range(1, alive + 1):
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
        except RankError:
            alive, resume = alive - 1, True
            if alive == 0:
                raise
