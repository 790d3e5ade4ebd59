# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the MLP adds
# the replicated output bias on every rank before g sums the ranks' partial outputs, so y carries P times the bias
# (and dL/d(proj b) is right only by accident of the sum). The communication is right; the numbers are not.
# EXPECT FAIL: megatron_mlp

# ANSWER: megatron_mlp
def megatron_mlp(x, fc_w, fc_b, proj_w, proj_b):
    h = F.gelu(f(x) @ fc_w.T + fc_b)
    return g(h @ proj_w.T + proj_b)
