# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: what lesson 11's restart does (parlab/runs/checkpoint.py, survivor_rows) when the
# batch does not split: every machine alive gets an equal share, and the rows left over are dropped. On 4 machines
# each takes 4 of the 18 rows: 16 rows a step until the first failure, so the parameters are not the uninterrupted
# run's, though every launch runs and the job finishes.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once, micro_batch_cost):
    from parlab.runtime.errors import RankError

    alive, resume = machines, False
    while True:
        rows = batch // alive
        micro = min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)
        try:
            return launch_run(alive, resume, rows, micro)
        except RankError as exc:
            if not exc.remote_traceback.startswith("the process exited"):
                raise
            alive, resume = alive - 1, True
            if alive == 0:
                raise
