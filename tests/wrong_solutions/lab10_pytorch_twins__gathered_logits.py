# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the loss gathers
# the vocabulary-sharded logits (full_tensor) and takes the plain cross-entropy: right numbers, but the [B, T, V]
# logits travel, which is what a vocabulary-parallel loss exists to avoid.
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
    loss = lab_loss(model(x).full_tensor(), y)
    loss.backward()
    return loss
