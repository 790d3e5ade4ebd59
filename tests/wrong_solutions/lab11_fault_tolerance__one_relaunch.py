# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (tests/test_wrong_answers.py grades it; the other answers are
# the solution's). The bug: one failure is survived (the relaunch on the survivors resumes from the checkpoint), but
# the relaunch is not watched: when it loses a rank too, that RankError reaches the caller and the job never ends.
# EXPECT FAIL: survive

# ANSWER: survive
def survive(launch_run, P):
    from parlab.runtime.errors import RankError

    try:
        return launch_run(P, resume=False)
    except RankError:
        return launch_run(P - 1, resume=True)
