# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: after the failure the survivors start over instead of loading the checkpoint. The
# global batch divides by 3, so they reach the same parameters: the work of steps 1-4 is thrown away, and the check
# sees that they did not resume from step 4.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, P):
    from parlab.launch import RankError

    try:
        return launch_run(P, resume=False)
    except RankError:
        return launch_run(P - 1, resume=False)
