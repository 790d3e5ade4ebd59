# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: any error is taken for a rank's death, and nothing stops the relaunches: a launch that
# fails before any rank starts is retried on 3, 2, 1, 0, -1 ... ranks, for ever. The check stops it after 8 launches
# (a FAIL line that says so) instead of the cell running until its timeout.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, P):
    world, resume = P, False
    while True:
        try:
            return launch_run(world, resume=resume)
        except Exception:
            world, resume = world - 1, True
