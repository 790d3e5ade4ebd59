# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the final norm
# gets SequenceParallel and nothing says how its token-split output is to meet the head. DTensor chooses by itself:
# the forward all-gathers the activation as it should, but the backward runs extra reduce-scatters and all-gathers.
# Numbers, shapes and logits are right; the backward's traffic is not the mirror of the forward's.
# EXPECT FAIL: sequence_parallel

# ANSWER: sequence_parallel
def apply_sp(model, mesh):
    tokens = Shard(1)
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=tokens), "norm": SequenceParallel()}
    if model.head is not None:
        plan["head"] = ColwiseParallel()
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn_norm": SequenceParallel(), f"{b}.mlp_norm": SequenceParallel()}
        plan[f"{b}.attn"] = PrepareModuleInput(
            input_layouts=(tokens, None), desired_input_layouts=(Replicate(), None), use_local_output=False
        )
        plan[f"{b}.mlp"] = PrepareModuleInput(
            input_layouts=(tokens,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        plan[f"{b}.attn.q"] = ColwiseParallel()
        plan |= {f"{b}.attn.{w}": WholeKV() for w in ("k", "v")}
        plan |= {f"{b}.mlp.{w}": ColwiseParallel() for w in ("gate", "up")}
        plan[f"{b}.attn.o"] = RowwiseParallel(output_layouts=tokens)
        plan[f"{b}.mlp.down"] = RowwiseParallel(output_layouts=tokens)
    parallelize_module(model, mesh, plan)
