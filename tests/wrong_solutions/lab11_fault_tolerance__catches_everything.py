# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: any error is taken for a rank's death. The failures are survived as they should be, but
# a launch that fails before any rank starts (a bad argument: every rank is alive) is retried on fewer and fewer
# ranks, from a checkpoint, instead of reaching the caller.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, P):
    world, resume = P, False
    while world > 0:
        try:
            return launch_run(world, resume=resume)
        except Exception:
            world, resume = world - 1, True
