# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: the most ranks that share the batch equally, as if fewer rows per rank always made the
# faster step; the micro-batches' fixed cost is never weighed. On 4 machines with 18 rows that is right (3 ranks);
# on 8 machines with 40 rows, 4 at once and a micro-batch costing 2 rows, 8 ranks of 5 rows need 5 micro-batches of
# 1 (15 rows' time a step) where 5 ranks of 8 rows in 2 of 4 take 12.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once, micro_batch_cost):
    from parlab.runtime.errors import RankError

    alive, resume = machines, False
    while True:
        world = max(w for w in range(1, alive + 1) if batch % w == 0)
        rows = batch // world
        micro = min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)
        try:
            return launch_run(world, resume, rows, micro)
        except RankError as exc:
            if not exc.remote_traceback.startswith("the process exited"):
                raise
            alive, resume = alive - 1, True
            if alive == 0:
                raise
