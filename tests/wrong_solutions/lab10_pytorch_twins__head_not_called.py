# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the lesson's GPT
# plan for the head, ColwiseParallel(use_local_output=False) on "head", as if the model called it. The lab model's
# logits() multiplies the final norm's plain output by head.weight, now a DTensor: DTensor refuses the mix, and the
# ranks fail.
# EXPECT FAIL: vocab_parallel

# ANSWER: vocab_parallel
def vocab_plan(model):
    plan = megatron_plan(model)
    plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    if model.head is not None:
        plan["head"] = ColwiseParallel(use_local_output=False)
    return plan


def loss_backward(model, x, y):
    with loss_parallel():
        loss = lab_loss(model(x), y)
        loss.backward()
    return loss
