# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: it is GPipe, all forwards then all backwards. It is complete, deadlock-free and has the same
# bubble, but every rank holds all m micro-batches' activations at once instead of p - r: the check on activations
# in flight catches it.
# EXPECT FAIL: order

# ANSWER: one_f_one_b
def one_f_one_b_actions(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
