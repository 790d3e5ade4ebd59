# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: after each failure the survivors start over instead of loading the checkpoint. They
# keep the global batch and plan each launch right, so they reach the same parameters: the work done before each
# failure is thrown away, and the check sees a relaunch from step 0.
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

    alive = machines
    while True:
        world, rows, micro = plan(alive)
        try:
            return launch_run(world, False, rows, micro)
        except RankError as exc:
            if not exc.remote_traceback.startswith("the process exited"):
                raise
            alive -= 1
            if alive == 0:
                raise
