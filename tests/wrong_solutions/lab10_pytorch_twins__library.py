# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the plan is
# parlab's own twin plan for the reference GPT (parlab.twins.tensor.tp_plan), renamed to the lab model's modules
# (proj -> o and down, fc -> gate, plus up). It runs and its numbers and traffic are right; every part that builds
# on it fails on the line naming the call (megatron_plan and vocab_plan start from tp_plan).
# EXPECT FAIL: tp_plan, megatron_plan, vocab_parallel

# ANSWER: tp_plan
from parlab.twins.tensor import tp_plan as twin_plan


def tp_plan(model):
    renamed = {"attn.proj": "attn.o", "mlp.fc": "mlp.gate", "mlp.proj": "mlp.down"}
    plan = {}
    for name, style in twin_plan(len(model.blocks)).items():
        if not name.startswith("blocks."):
            continue
        for old, new in renamed.items():
            name = name.replace(old, new)
        plan[name] = style
        if name.endswith("mlp.gate"):
            plan[name.replace("gate", "up")] = ColwiseParallel()
    return plan
