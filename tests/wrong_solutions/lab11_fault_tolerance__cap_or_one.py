# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: micro-batches of as many rows as a rank holds at once when that divides its rows, else
# of one row, never of a size in between; the number of ranks is then chosen by the step's cost, right. With 2 rows
# at once (job 1: 6 rows, then 9) that is the fewest micro-batches; with 4 at once and 10 rows a rank, it makes 10
# micro-batches of 1 row where 5 of 2 fit, and the step costs more than it need (job 2 on 4 machines).
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once, micro_batch_cost):
    from parlab.runtime.errors import RankError

    def plan(alive):
        best = None
        for world in range(1, alive + 1):
            if batch % world == 0:
                rows = batch // world
                micro = rows // rows_at_once if rows % rows_at_once == 0 else rows
                cost = rows + micro * micro_batch_cost
                if best is None or cost < best[0]:
                    best = (cost, world, rows, micro)
        return best[1:]

    alive, resume = machines, False
    while True:
        world, rows, micro = plan(alive)
        try:
            return launch_run(world, resume, rows, micro)
        except RankError as exc:
            if not exc.remote_traceback.startswith("the process exited"):
                raise
            alive, resume = alive - 1, True
            if alive == 0:
                raise
