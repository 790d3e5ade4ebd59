# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the library's
# (and torchtitan's) template, renamed by hand: q, k, v, gate, up ColwiseParallel, o and down RowwiseParallel. With one
# K/V head on two ranks, ColwiseParallel hands each rank half of the K/V head's features, and the attention cannot
# cut a half head into heads: the ranks fail. Parts 2, 3 and 4
# put their own style on k and v, and pass.
# EXPECT FAIL: tp_plan

# ANSWER: tp_plan
def tp_plan(model):
    plan = {}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.{w}": ColwiseParallel() for w in ("q", "k", "v")}
        plan[f"{b}.attn.o"] = RowwiseParallel()
        plan |= {f"{b}.mlp.{w}": ColwiseParallel() for w in ("gate", "up")}
        plan[f"{b}.mlp.down"] = RowwiseParallel()
    return plan
