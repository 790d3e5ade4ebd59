# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the untied head's
# ends used for the tied head as well: every token looked up in the whole table and this rank's kept (their gradient
# all-gathered in backward), the table's gradient summed for the head. Untied, right in every line. Tied, the table's
# gradient arrives as one: the lookup's share, already whole on every rank after the gather, is summed with the
# head's shares and counted P times (embed.weight's gradient differs), and the gather was paid for beside the sum.
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
    plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=tokens)
    parallelize_module(model, mesh, plan)
    group = mesh.get_group()
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
