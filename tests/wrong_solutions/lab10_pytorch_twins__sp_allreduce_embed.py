# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: lesson 10's twin
# way into the sequence-split stream for the untied head: the embedding split over the vocabulary, its lookup's sum
# all-reduced (a whole [B, T, H] on every rank), then the first block's input sliced to this rank's tokens (whose
# backward all-gathers). The numbers are right; block 0 receives the whole [B, T, H] (the slice is its own pre-hook),
# and the untied forward all-reduces an activation that a whole table would not have moved. The tied head is the
# solution's.
# EXPECT FAIL: sequence_parallel

# ANSWER: sequence_parallel
def apply_sp(model, mesh):
    tokens = Shard(1)
    plan = {"norm": SequenceParallel(use_local_output=True)}
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
    if model.head is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())
        plan["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(tokens, None), use_local_output=True
        )
    parallelize_module(model, mesh, plan)
    rank, ranks, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    if model.head is None:
        model.embed.register_forward_pre_hook(lambda module, inputs: (own_tokens(inputs[0], rank, ranks),))
    table = model.embed.weight if model.head is None else model.head.weight
    table.register_hook(lambda grad: summed(grad, group))


def own_tokens(t, rank, ranks):
    T = t.shape[1]
    return t[:, rank * T // ranks : (rank + 1) * T // ranks]


def summed(grad, group):
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def sp_loss_backward(model, x, y):
    rank, ranks = dist.get_rank(), dist.get_world_size()
    logits = model(x)
    mine = own_tokens(y, rank, ranks)
    share = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine.reshape(-1), reduction="sum") / y.numel()
    share.backward()
    loss = share.detach().clone()
    dist.all_reduce(loss)
    return loss
