# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the ready-made
# ends of Megatron-SP, as torchtitan writes them: the embedding split over the vocabulary and its lookup's sum
# reduce-scattered by tokens, the final norm's tokens all-gathered into a head split over the vocabulary, the loss
# on vocabulary-sharded logits (part 3's). Numbers, shapes and logits are right, for both heads; with more tokens
# than vocabulary, both ends move more bytes than they need.
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
        plan |= {f"{b}.attn.{w}": KVWeightSum() for w in ("k", "v")}
        plan |= {f"{b}.mlp.{w}": ColwiseParallel() for w in ("gate", "up")}
        plan[f"{b}.attn.o"] = RowwiseParallel(output_layouts=tokens)
        plan[f"{b}.mlp.down"] = RowwiseParallel(output_layouts=tokens)
    parallelize_module(model, mesh, plan)
    parallelize_module(
        model.norm,
        mesh,
        PrepareModuleOutput(output_layouts=tokens, desired_output_layouts=Replicate(), use_local_output=False),
    )


sp_loss_backward = loss_backward  # part 3's: the loss on vocabulary-sharded logits
