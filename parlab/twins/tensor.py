"""Twins of the schemes that split the weights: TP, Megatron SP, and the hybrid's DP x TP, all with DTensor.

parlab's TensorParallelGPT replaces each Linear by a column- or row-parallel one and writes the all-reduces (f, g)
by hand. PyTorch takes the unchanged model and a *plan*, a dict {module name: style}:

    mesh = init_device_mesh(parlab.device().type, (P,), mesh_dim_names=("tp",))   # "cpu" under gloo
    parallelize_module(model, mesh, {"blocks.0.attn.q": ColwiseParallel(), "blocks.0.attn.proj": RowwiseParallel(),
                                     ..., "wte": RowwiseParallel(input_layouts=Replicate()),   # vocab-parallel
                                     "lm_head": ColwiseParallel(use_local_output=False)})
    with loss_parallel():                                   # cross-entropy on vocab-sharded logits
        loss = lm_loss(model(x), y); loss.backward()

Each style swaps the module's weight for a DTensor (ColwiseParallel: Shard(0) of the [out, in] weight, so rank r
holds output features r; RowwiseParallel: Shard(1)) and wraps its forward: a RowwiseParallel output is a
Partial(sum) DTensor, and turning it into Replicate (its default output layout) *is* the all-reduce parlab calls g.
Megatron SP adds SequenceParallel on the LayerNorms and PrepareModuleInput before attention and MLP: the Partial
becomes Shard(1) (a reduce-scatter), and Shard(1) -> Replicate before q, k, v and fc (an all-gather).

The one change the model needs is the torchtitan one: attention views its heads with -1, so the same code runs
on a rank's nh/P local heads (`local_heads`).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.distributed as dist

from parlab.core import comm
from parlab.core.check import Verdict, compare, host_values
from parlab.core.models import causal_attention, lm_loss, make_batches, make_optimizer
from parlab.twins.record import unrecorded
from parlab.twins.twin import Twin


def tp_plan(layers: int, sequence_parallel: bool = False) -> dict:
    """The parallelize_module plan of parlab's GPT: Megatron's splits (and Megatron SP's, if asked)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(1) if sequence_parallel else Replicate()  # what a row-parallel layer leaves: [B, T/P, H] or [B, T, H]
    plan = {"wte": RowwiseParallel(input_layouts=Replicate())}  # vocab-parallel embedding: rows of [V, H]
    plan["lm_head"] = ColwiseParallel(input_layouts=out, use_local_output=False)  # logits stay Shard(-1) DTensors
    for i in range(layers):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.{w}": ColwiseParallel() for w in ("q", "k", "v")}
        plan |= {f"{b}.attn.proj": RowwiseParallel(output_layouts=out), f"{b}.mlp.fc": ColwiseParallel()}
        plan[f"{b}.mlp.proj"] = RowwiseParallel(output_layouts=out)
        if sequence_parallel:
            plan |= {f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel()}
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan |= {f"{b}.attn": gather, f"{b}.mlp": gather}
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
        # The embedding's sum is replicated; the first block takes its sequence chunk (a local slice, no traffic).
        plan["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    return plan


def _local_heads_forward(self, x: torch.Tensor) -> torch.Tensor:
    """SelfAttention.forward with heads viewed as -1: on a TP rank q, k, v hold nh/P heads. x: [B, T, H]."""
    B, T = x.shape[0], x.shape[1]
    hs = self.head_size

    def split_heads(t):  # [B, T, nh/P * hs] -> [B, nh/P, T, hs]
        return t.view(B, T, -1, hs).transpose(1, 2)

    y = causal_attention(split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x)))
    return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def local_heads(model) -> None:
    """Let every attention layer of `model` run on however many heads its rank holds."""
    for block in model.blocks:
        block.attn.head_size = model.cfg.hidden // model.cfg.heads
        block.attn.forward = types.MethodType(_local_heads_forward, block.attn)


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather, left out of the twin's traffic), or the plain tensor."""
    with unrecorded():
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train_dtensor(model, opts, batches, rows: slice | None = None) -> dict:
    """Train a parallelize_module'd model; returns the losses, step 1's gradients and the final parameters, full.

    rows: this rank's rows of each batch (a data-parallel replica); None: all of them."""
    from torch.distributed.tensor.parallel import loss_parallel

    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    losses, grads = [], {}
    for step, (x, y) in enumerate(batches):
        if rows is not None:
            x, y = x[rows], y[rows]
        optimizer.zero_grad()
        with loss_parallel():  # cross-entropy on Shard(-1) logits: the 3 small all-reduces of parlab's vocab loss
            loss = lm_loss(model(x), y)
            loss.backward()
        if step == 0:  # a SequenceParallel LayerNorm's grad is Partial(sum): full_tensor() is where it is reduced
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(full(loss).item())
    return {"losses": losses, "grads": grads, "params": {n: full(p) for n, p in model.named_parameters()}}


def tp_rank(opts, value) -> dict:
    """torch's tensor parallelism (Megatron SP too, for method megatron-sp) on the reference GPT."""
    from torch.distributed.device_mesh import init_device_mesh

    from parlab.core.models import build_model

    cfg, dev = opts.gpt_config(), comm.device()  # the mesh, the model and the data on this rank's device
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = build_model(cfg, opts.seed, device=dev)  # the same weights as parlab's ranks start from
    parallelize_module_(model, mesh, tp_plan(cfg.layers, getattr(opts, "method", "") == "megatron-sp"))
    return train_dtensor(model, opts, make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev))


def parallelize_module_(model, mesh, plan) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    with unrecorded():  # the set-up (each rank's slice of the weights) is not training traffic
        parallelize_module(model, mesh, plan)
    local_heads(model)


def tp_compare(opts, results, outs) -> list[Verdict]:
    """parlab's slices gathered to full shape (as its own report does) vs torch's DTensors' full values."""
    from parlab.schemes.tensor_parallel import gather_full

    dims, K, dtype = results[0]["split_dims"], opts.steps, opts.gpt_config().torch_dtype
    ours = {k: gather_full([r[k] for r in results], dims) for k in ("grads", "params")}
    what = "torch parallelize_module"
    return [
        compare(
            f"parlab's loss of each of {K} steps",
            host_values(results[0]["losses"], dtype),
            host_values(outs[0]["losses"], dtype),
            against=what,
        ),
        compare("parlab's gradients of step 1, full shape", ours["grads"], outs[0]["grads"], against=what),
        compare(f"parlab's parameters after {K} steps", ours["params"], outs[0]["params"], against=what),
    ]


# ----------------------------------------------------------------------------------------------- the hybrid


def hybrid_skip(opts) -> str:
    if opts.pp > 1:
        return (
            "the twin composes fully_shard (dp) and parallelize_module (tp) on one DeviceMesh; with pp > 1 it would "
            "also need torch.distributed.pipelining on DTensor stages, not composed here (run pp alone for its twin)"
        )
    if opts.cp > 1:
        return (
            "the twin composes fully_shard (dp) and parallelize_module (tp) on one DeviceMesh; with cp > 1 it would "
            "also need torch's context_parallel on the cp axis, not composed here (run ring, ulysses or usp alone for "
            "theirs)"
        )
    if getattr(opts, "experts", 0):
        return (
            "the twin has no MoE: parallelize_module's plans and fully_shard do not route tokens to experts "
            "(run moe alone for the expert all-to-alls checked against one device)"
        )
    return ""


def hybrid_rank(opts, value) -> dict:
    """The torchtitan composition: parallelize_module on the tp axis, then fully_shard on the dp axis."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parlab.core.models import build_model

    # Gathering a 2-D sharded parameter for the comparison takes two all-gathers; torch warns about it, per rank.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg, dev = opts.gpt_config(), comm.device()  # the mesh, the model and the data on this rank's device
    mesh = init_device_mesh(dev.type, (opts.dp, opts.tp), mesh_dim_names=("dp", "tp"))  # rank = dp x tp + tp: parlab's
    model = build_model(cfg, opts.seed, device=dev)
    parallelize_module_(model, mesh["tp"], tp_plan(cfg.layers, opts.sequence_parallel))
    with unrecorded():
        for block in model.blocks:  # each block's parameters gathered (dp) just before it runs
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    rows = opts.batch // opts.dp
    replica = mesh["dp"].get_local_rank()
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)
    return train_dtensor(model, opts, batches, slice(replica * rows, (replica + 1) * rows))


def hybrid_compare(opts, results, outs) -> list[Verdict]:
    """Replica 0's parameters gathered over tp, and the loss (mean over the replicas), vs torch's."""
    from parlab.schemes.tensor_parallel import gather_full

    ranks0 = list(range(opts.tp))  # replica 0's tp group (pp = 1)
    params = gather_full([results[r]["params"] for r in ranks0], results[0]["split_dims"])
    replicas = [d * opts.tp for d in range(opts.dp)]
    dtype, K = opts.gpt_config().torch_dtype, opts.steps
    ours = host_values((sum(results[r]["losses"][k] for r in replicas) / opts.dp for k in range(K)), dtype)
    theirs = host_values((sum(outs[r]["losses"][k] for r in replicas) / opts.dp for k in range(K)), dtype)
    what = "torch fully_shard x parallelize_module"
    return [
        compare(f"parlab's loss of each of {K} steps", ours, theirs, against=what),
        compare(f"parlab's parameters after {K} steps", params, outs[0]["params"], against=what),
    ]


TWINS = {
    "tp": Twin("torch parallelize_module (ColwiseParallel / RowwiseParallel)", tp_rank, tp_compare),
    "megatron-sp": Twin("torch parallelize_module + SequenceParallel / PrepareModuleInput", tp_rank, tp_compare),
    "hybrid": Twin("torch fully_shard (dp) x parallelize_module (tp)", hybrid_rank, hybrid_compare, hybrid_skip),
}
