# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the stream's ends
# written for the untied head only (the whole table's lookup sliced to this rank's tokens, the whole head's gradient
# summed), giving up on a model whose head is the embedding matrix (head None): the untied run is right in every
# line, the tied one never runs.
# EXPECT FAIL: sequence_parallel

# ANSWER: sequence_parallel
def apply_sp(model, mesh):
    if model.head is None:
        raise NotImplementedError("a tied head: the embedding is the head")
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
    plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=tokens)
    parallelize_module(model, mesh, plan)
    group = mesh.get_group()
    model.head.weight.register_hook(lambda grad: summed(grad, group))


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
