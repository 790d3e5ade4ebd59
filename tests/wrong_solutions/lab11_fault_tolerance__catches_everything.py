# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: any error is taken for a rank's death. The failure of step 5 is survived as it should
# be, but a launch that fails before any rank starts (a bad argument: every rank is alive) is retried on one rank
# fewer, from a checkpoint, instead of reaching the caller.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, P):
    try:
        return launch_run(P, resume=False)
    except Exception:
        return launch_run(P - 1, resume=True)
