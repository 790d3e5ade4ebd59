"""Hybrid parallelism: data, pipeline and tensor parallelism at once, each on its own axis of a device mesh.

Large models are trained with several schemes at once (Megatron-LM's "3D parallelism", Narayanan et al. 2021).
On D x S x T ranks, arranged as a mesh with axes ("dp", "pp", "tp"), the last axis fastest:

    rank = (dp * S + pp) * T + tp       TP partners are neighbours (on a real cluster: the fast links of one node)

each rank takes part in three groups, and every scheme talks only within its own:

    tp group (T ranks)  the same stage of the same replica: each holds 1/T of the stage's big weight matrices
                        (parlab/tensor_parallel.py); per block and micro-batch 2 all-reduces of [b, T, H]
                        forward (g) and 2 backward (f)
    pp group (S ranks)  the same replica: each holds the blocks of one pipeline stage (parlab/pipeline.py) and
                        sends one activation [b, T, H] forward and one gradient back per micro-batch and hop
    dp group (D ranks)  the same shard of the same stage in every replica: each trains on its B/D rows of the
                        batch, then all-reduces its gradients over this group (parlab/data_parallel.py)

The building blocks are the very ones of the single schemes; composing them is a matter of handing each the
right process group. A rank's weights are (its stage's blocks) x (its 1/T slice), so its parameter, gradient
and optimizer memory shrink by S x T (less the replicated LayerNorms and biases), and its all-reduce over dp
moves only that share.

Two options change what an axis does:
    zero_stage=1         ZeRO stage 1 over the dp axis (parlab/zero.py): instead of all-reducing the gradients, a
                         rank reduce-scatters them over dp, runs Adam on its 1/D shard of the optimizer states and
                         all-gathers the updated parameters (pipelines accumulate gradients over micro-batches, so
                         the stages that reduce during backward, 2 and 3, do not apply here)
    sequence_parallel    Megatron SP on the tp axis (parlab/sequence_parallel.py): LayerNorm regions split along
                         the sequence, all-gather / reduce-scatter instead of all-reduce (needs pp = 1: a stage
                         boundary would cut a sequence-split activation)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from parlab.data_parallel import all_reduce_gradients, shard_batch, train_data_parallel
from parlab.memory import state_bytes, tensor_bytes
from parlab.mesh import DeviceMesh
from parlab.models import GPT, GPTConfig, lm_loss, make_optimizer
from parlab.pipeline import Stage, build_stages, split_layers, theory_send_bytes, train_pipeline
from parlab.schedules import Schedule
from parlab.sequence_parallel import MegatronSPGPT
from parlab.tensor_parallel import TensorParallelGPT, allreduce_theory, split_dims
from parlab.zero import ZeRO

AXES = ("dp", "pp", "tp")


def hybrid_stages(model: GPT, mesh: DeviceMesh, schedule: Schedule, split: Sequence[int] | None = None):
    """This rank's pipeline stages, each holding this rank's TP slices: the model is first split by columns and
    rows over the tp group (as on one TP rank), then cut into the stages of the pp group."""
    if mesh.size("tp") > 1:
        model = TensorParallelGPT(model, group=mesh.group("tp"))  # same names as the GPT: stages cut it alike
        loss_fn = model.loss_from_logits  # the last stage's logits are split by vocabulary: 3 all-reduces
    else:
        loss_fn = lm_loss
    return build_stages(model, schedule, mesh.index("pp"), split, loss_fn)


def train_hybrid(
    model: GPT,
    mesh: DeviceMesh,
    schedule: Schedule,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    optimizer: str = "sgd",
    lr: float = 0.1,
    split: Sequence[int] | None = None,
    zero_stage: int = 0,
    sequence_parallel: bool = False,
) -> dict:
    """Rank code: train the GPT with DP x PP x TP on `mesh` (axes "dp", "pp", "tp").

    model: the full reference model (the same on every rank: each keeps its slices of its stages).
    optimizer, lr: "sgd" or "adam" (parlab.models.make_optimizer). batches: the global batches [B, T], the same
    on every rank; replica
    dp takes rows [dp B/D, (dp+1) B/D), which its pipeline cuts into the schedule's m micro-batches.
    Returns the pipeline's results (losses on the last stage, first-step gradients, final parameters by the
    reference model's names, this rank's slices), how each parameter is split over tp, and the bytes it holds.
    zero_stage=1: ZeRO-1 over dp with its own Adam (optimizer must be "adam"). sequence_parallel: Megatron SP
    over tp (pp must be 1).
    """
    if sequence_parallel:
        return _train_sequence_parallel(model, mesh, optimizer, lr, batches, schedule.m)
    stages = hybrid_stages(model, mesh, schedule, split)
    held = nn.ModuleList(stages.values())  # this rank's weights: its stages' blocks, its TP slices of them
    replica, replicas = mesh.index("dp"), mesh.size("dp")
    rows = [shard_batch(x, y, replica, replicas) for x, y in batches]  # [B/D, T] each
    dp_group = mesh.group("dp")
    if zero_stage:
        stepper = _ZeROStepper(ZeRO(held, zero_stage, lr=lr, group=dp_group))
        grad_sync = None  # ZeRO's step reduce-scatters the gradients over dp itself
    else:
        stepper = make_optimizer(held.parameters(), optimizer, lr)
        # after each step's backward: average the gradients over the replicas, within the dp group only
        grad_sync = (lambda: all_reduce_gradients(held, group=dp_group)) if replicas > 1 else None
    out = train_pipeline(
        schedule,
        stages,
        stepper,
        rows,
        group=mesh.group("pp"),
        grad_group=mesh.twin_group("pp"),  # the pipeline's gradients on a channel of their own
        grad_sync=grad_sync,
    )
    if zero_stage:
        stepper.zero.remove()
    named = {name: p for stage in stages.values() for name, p in stage.named.items()}
    return {
        **out,
        "split_dims": {name: getattr(p, "tp_split_dim", None) for name, p in named.items()},
        "coords": mesh.coords,
        "param_bytes": tensor_bytes(held.parameters()),  # measured from the tensors this rank holds
        # params, grads, optimizer states after the last step (ZeRO: its flat buffers and shards)
        "state_bytes": stepper.zero.held() if zero_stage else state_bytes(held, stepper),
    }


class _ZeROStepper:
    """ZeRO behind the two calls the pipeline's loop makes of an optimizer."""

    def __init__(self, zero: ZeRO):
        self.zero, self.steps = zero, 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad()  # stage 1: the .grad are views of flat buffers: zero them, keep them

    def step(self) -> None:
        self.zero.step(self.steps)
        self.steps += 1


def _train_sequence_parallel(model: GPT, mesh: DeviceMesh, optimizer: str, lr: float, batches, m: int) -> dict:
    """DP x TP with Megatron SP on the tp axis (no pipeline): the SP model over tp, the DP loop over dp."""
    if mesh.size("pp") != 1:
        raise ValueError("Megatron SP in the hybrid needs pp = 1 (a stage boundary would cut a sequence shard)")
    sp_model = MegatronSPGPT(model, group=mesh.group("tp"))
    stepper = make_optimizer(sp_model.parameters(), optimizer, lr)
    out = train_data_parallel(
        sp_model,
        stepper,
        batches,
        mode="dp-naive",
        microbatches=m,
        group=mesh.group("dp"),
        loss_fn=lambda model, x, y: model.loss(x, y),
        grad_sync=sp_model.sync_grads,  # the LayerNorms' partial gradients, summed over the tp group
    )
    return {
        **out,
        "split_dims": {n: getattr(p, "tp_split_dim", None) for n, p in sp_model.named_parameters()},
        "coords": mesh.coords,
        "param_bytes": tensor_bytes(sp_model.parameters()),
        "state_bytes": state_bytes(sp_model, stepper),
    }


# ------------------------------------------------------------------------------------------------- the theory


def stage_names(cfg: GPTConfig, stage: int, layers: range, num_stages: int) -> list[str]:
    """The reference model's parameter names that pipeline stage `stage` holds (as Stage decides them)."""
    return list(Stage(GPT(cfg), stage, num_stages, layers).named)


def hybrid_param_bytes(cfg: GPTConfig, stage: int, layers: range, num_stages: int, tp: int) -> int:
    """Bytes of parameters one rank of pipeline stage `stage` holds: its stage's tensors, the ones tensor
    parallelism splits divided by T, the replicated ones whole."""
    full = GPT(cfg)
    dims = split_dims(TensorParallelGPT(full))  # which names TP splits (built here outside any group: T = 1)
    numel = dict((name, p.numel()) for name, p in full.named_parameters())
    names = stage_names(cfg, stage, layers, num_stages)
    return sum(numel[n] // (tp if dims[n] is not None else 1) for n in names) * cfg.dtype_bytes


def hybrid_comm_theory(
    cfg: GPTConfig, schedule: Schedule, batch: int, dp: int, tp: int, split=None, zero_stage: int = 0
) -> list[dict[str, dict[str, int]]]:
    """Payload bytes per rank per training step, by pipeline stage, axis and kind of call:

    tp: the Megatron all-reduces of the stage's blocks (4 x [b, T, H] per block and micro-batch), plus the
        vocab-parallel embedding (stage 0) and LM head and loss (last stage); b = B / (D m) rows a micro-batch
    pp: the activations and gradients the stage's rank sends ([b, T, H] each)
    dp: one all-reduce of all the gradients the rank holds (= its parameter bytes); with ZeRO-1, a reduce-scatter
        of its flat gradients (padded to D x S, S = ceil(numel / D)) and an all-gather of its shard (S)
    """
    S, m, e = schedule.p, schedule.m, cfg.dtype_bytes
    ranges = split_layers(cfg.layers, S, split)
    b = batch // (dp * m)
    per_mb = allreduce_theory(cfg, b)  # one micro-batch, every layer: its per-layer items are L x [b, T, H]
    block = sum(per_mb[k] for k in ("g fwd attn", "g fwd mlp", "f bwd attn", "f bwd mlp")) // cfg.layers
    first = per_mb["g fwd embed"]
    last = per_mb["f bwd lm_head"] + per_mb["loss max"] + per_mb["loss sum-exp"] + per_mb["loss target logit"]
    sends = theory_send_bytes(schedule, b * cfg.seq_len * cfg.hidden * e)
    rows = []
    for s, layers in enumerate(ranges):
        tp_bytes = m * (len(layers) * block + (first if s == 0 else 0) + (last if s == S - 1 else 0))
        held = hybrid_param_bytes(cfg, s, layers, S, tp)
        if dp == 1:
            dp_calls = {}
        elif zero_stage:
            shard = math.ceil(held // e / dp) * e  # this stage is one ZeRO unit: its flat parameters, padded
            dp_calls = {"reduce_scatter": dp * shard, "all_gather": shard}
        else:
            dp_calls = {"all_reduce": held}
        rows.append({"tp": {"all_reduce": tp_bytes} if tp > 1 else {}, "pp": {"send": sends[s]}, "dp": dp_calls})
    return rows
