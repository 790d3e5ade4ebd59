# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The library's 1F1B called
# instead of written: parlab.schemes.pipeline.schedules.one_f_one_b gives rank r's order for any p and m (m < p too,
# called directly rather than through make_schedule). Every number is right; the check sees the call and names it.
# EXPECT FAIL: order

# ANSWER: one_f_one_b
from parlab.schemes.pipeline.schedules import one_f_one_b


def one_f_one_b_actions(rank, p, m):
    return [(a.op, a.mb) for a in one_f_one_b(p, m).actions[rank]]
