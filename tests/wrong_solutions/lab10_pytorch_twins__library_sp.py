# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: parlab's own
# Megatron-SP plan for the reference GPT (parlab/twins/tensor.py, tp_plan(layers, sequence_parallel=True)) pasted
# and renamed to the lab model's modules (wte -> embed, ln1/ln2/ln_f -> attn_norm/mlp_norm/norm, attn.proj -> o,
# mlp.fc -> gate and up, mlp.proj -> down, lm_head -> head, absent when tied), the positions passed through the
# attention's and the first block's input styles, k and v given part 2's whole-K/V-head style (the twin splits them
# by heads, which one K/V head on two ranks does not allow), the loss part 3's. It does not call parlab's code; its
# ends (the lookup's sum all-reduced then sliced, the tokens gathered into a vocabulary-split head) move more bytes
# than the least.
# EXPECT FAIL: sequence_parallel

# ANSWER: sequence_parallel
def apply_sp(model, mesh):
    out = Shard(1)  # what a row-parallel layer leaves: [B, T/P, H]
    plan = {"embed": RowwiseParallel(input_layouts=Replicate())}  # vocab-parallel embedding: rows of [V, H]
    if model.head is not None:
        plan["head"] = ColwiseParallel(input_layouts=out, use_local_output=False)  # logits stay Shard(-1) DTensors
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan[f"{b}.attn.q"] = ColwiseParallel()
        plan |= {f"{b}.attn.{w}": KVWeightSum() for w in ("k", "v")}
        plan |= {f"{b}.attn.o": RowwiseParallel(output_layouts=out), f"{b}.mlp.gate": ColwiseParallel()}
        plan[f"{b}.mlp.up"] = ColwiseParallel()
        plan[f"{b}.mlp.down"] = RowwiseParallel(output_layouts=out)
        plan |= {f"{b}.attn_norm": SequenceParallel(), f"{b}.mlp_norm": SequenceParallel()}
        plan[f"{b}.attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        )
        plan[f"{b}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan["norm"] = SequenceParallel()
    # The embedding's sum is replicated; the first block takes its sequence chunk (a local slice, no traffic).
    plan["blocks.0"] = PrepareModuleInput(
        input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True
    )
    parallelize_module(model, mesh, plan)


sp_loss_backward = loss_backward  # part 3's: the loss on vocabulary-sharded logits
