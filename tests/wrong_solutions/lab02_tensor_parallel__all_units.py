# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (the
# data-parallel route): every rank is handed the whole weights, so it runs the whole MLP, all F units, on its own
# tokens: exact, no communication, nothing over the memory bound. But every unit's weights are used on every rank
# (the weights of a real layer do not fit on one), and each rank does P times the GEMM work of its share on its
# tokens.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, gate, up, down, layout):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
