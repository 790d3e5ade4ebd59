# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: a sequence-parallel
# plan written for the untied head only, which gives up on a model whose head is the embedding matrix (head None):
# the untied run is right in every line, the tied one never runs.
# EXPECT FAIL: sequence_parallel

# ANSWER: sequence_parallel
def apply_sp(model, mesh):
    if model.head is None:
        raise NotImplementedError("a tied head: the embedding is the head")
    tokens = Shard(1)
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=tokens),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(),
    }
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
