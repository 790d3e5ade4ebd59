# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: f and g are the
# library's own (parlab.schemes.tensor_parallel's copy_to_tensor_parallel and reduce_from_tensor_parallel), imported
# instead of written. The numbers and the calls are right, and so are the MLP's and the attention's, which use them:
# every part that runs them fails on the line naming the call.
# EXPECT FAIL: conjugates, swiglu, gqa

# ANSWER: conjugates
from parlab.schemes.tensor_parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel


def f(x):
    return copy_to_tensor_parallel(x)


def g(partial):
    return reduce_from_tensor_parallel(partial)
