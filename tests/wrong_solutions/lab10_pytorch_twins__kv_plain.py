# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: k and v are left
# out of the plan, as plain Linears, "whole on every rank". The forward is right; but each rank's attention reads the
# K/V head with its own query heads only, so each rank's gradient of k and v (and their share of dL/dx) is that rank's
# part: the weights' gradients are wrong on every rank, and so is every gradient below the first block. The plan
# also names fewer Linears than it should. Parts 2, 3 and 4
# put their own style on k and v, and pass.
# EXPECT FAIL: tp_plan

# ANSWER: tp_plan
def tp_plan(model):
    plan = {}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan[f"{b}.attn.q"] = ColwiseParallel()
        plan[f"{b}.attn.o"] = RowwiseParallel()
        plan |= {f"{b}.mlp.{w}": ColwiseParallel() for w in ("gate", "up")}
        plan[f"{b}.mlp.down"] = RowwiseParallel()
    return plan
