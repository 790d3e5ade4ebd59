# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: one failure is survived (the relaunch on the machines left keeps the batch and resumes
# from the checkpoint), but the relaunch is not watched: when it loses a machine too, that RankError reaches the
# caller and the job never ends.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, machines, batch, rows_at_once):
    from parlab.runtime.errors import RankError

    def plan(alive):
        world = max(w for w in range(1, alive + 1) if batch % w == 0)
        rows = batch // world
        micro = min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)
        return world, rows, micro

    world, rows, micro = plan(machines)
    try:
        return launch_run(world, False, rows, micro)
    except RankError:
        world, rows, micro = plan(machines - 1)
        return launch_run(world, True, rows, micro)
