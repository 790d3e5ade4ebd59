# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (tests/test_labs.py grades it). The bug: it is GPipe, all
# forwards then all backwards. It runs and its gradients are right, and so is its bubble, but every rank holds all
# m micro-batches' activations at once instead of p - r: the checks on activations in flight catch it.
# EXPECT FAIL: order, run

# ANSWER: one_f_one_b
def one_f_one_b_actions(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
