# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The checks' own reference
# called: what each rank holds is read off parlab/grading/labs/lab07_layout.py (the grader's layout, importable like
# any module) instead of worked out. Every shape and byte is right; the check sees the calls and fails the part.
# EXPECT FAIL: memory

# ANSWER: memory
from parlab.grading.labs import lab07_layout


def local_shapes(cfg, axes, rank):
    return lab07_layout.held_shapes(cfg, axes, rank)


def state_bytes(cfg, axes, rank):
    return lab07_layout.held_states(cfg, axes, rank)
