# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the untied head
# right, the tied one by torchtitan's vocabulary-parallel lookup (RowwiseParallel on the embedding): its [B, T, H]
# output summed over the ranks, an all-reduce of B T H numbers, where gathering the table's shards ([V/P, H] a rank,
# fewer numbers once B T > V/P, and a free slice in backward) costs less. Numbers, placements and backward right.
# EXPECT FAIL: vocab_parallel

# ANSWER: vocab_parallel
def vocab_plan(model):
    plan = megatron_plan(model)
    if model.head is not None:
        plan["head"] = ColwiseParallel()
    else:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())  # the lookup's [B, T, H] summed
    plan["norm"] = PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
    )
    return plan


def loss_backward(model, x, y):
    with loss_parallel():
        loss = lab_loss(model(x), y)
        loss.backward()
    return loss
