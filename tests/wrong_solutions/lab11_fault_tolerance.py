# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: after each failure the survivors start over instead of loading the checkpoint. The
# global batch divides by 3 and by 2, so they reach the same parameters: the work done before each failure is
# thrown away, and the check sees that they did not resume from step 4.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, P):
    from parlab.runtime.errors import RankError

    while True:
        try:
            return launch_run(P, resume=False)
        except RankError:
            P -= 1
