# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: torchtitan's
# plan, the embedding split over the vocabulary by the vocabulary-parallel lookup whatever the head: the untied
# embedding could stay whole (its lookup sends nothing and its output's gradient is whole on every rank already):
# split, it costs one more all-reduce of [B, T, H] in forward; the tied head pays that all-reduce too.
# EXPECT FAIL: vocab_parallel

# ANSWER: vocab_parallel
def vocab_plan(model):
    plan = megatron_plan(model)
    plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    if model.head is not None:
        plan["head"] = ColwiseParallel()
    plan["norm"] = PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
    )
    return plan


def loss_backward(model, x, y):
    with loss_parallel():
        loss = lab_loss(model(x), y)
        loss.backward()
    return loss
