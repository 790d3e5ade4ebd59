# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: Megatron's f put
# in front of each sub-layer, but the K/V head kept part 1's style, which sums each rank's share of k's and v's
# output gradient, [B, T, nkv hd]. Once x's gradient is summed by the sub-layer's one all-reduce anyway, only the
# weights' gradients, [nkv hd, H], still need a sum: half the bytes at B T = 2 H. Numbers and counts of [B, T, H] are
# right; the bytes beside them are not. Part 3 accepts part 1's K/V bytes, so it passes; part 4 (the solution's)
# uses the weight-summing K/V style this answer never wrote, and fails.
# EXPECT FAIL: megatron_plan, sequence_parallel

# ANSWER: megatron_plan
def megatron_plan(model):
    plan = tp_plan(model)
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan[f"{b}.attn"] = PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None), use_local_output=False
        )
        plan[f"{b}.mlp"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
    return plan
