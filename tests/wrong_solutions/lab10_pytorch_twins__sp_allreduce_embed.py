# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: lesson 10's twin
# way into the sequence-split stream: the embedding's sum all-reduced (a whole [B, T, H] on every rank), then the
# first block's input sliced to this rank's tokens. The numbers are right; the forward all-reduces an activation that
# a reduce-scatter would have split (and the slice's backward adds an all-gather).
# EXPECT FAIL: sequence_parallel

# ANSWER: sequence_parallel
def apply_sp(model, mesh):
    tokens = Shard(1)
    plan = {"embed": RowwiseParallel(input_layouts=Replicate()), "norm": SequenceParallel()}
    plan["blocks.0"] = PrepareModuleInput(
        input_layouts=(Replicate(), None), desired_input_layouts=(tokens, None), use_local_output=True
    )
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
    parallelize_module(
        model.norm,
        mesh,
        PrepareModuleOutput(output_layouts=tokens, desired_output_layouts=Replicate(), use_local_output=False),
    )
