"""Pipeline parallelism: the GPT's layers cut into stages, micro-batches flowing through them on a schedule.

Notation (as in the GPipe, Megatron-LM and zero-bubble papers): p stages = ranks of the pipeline group, m
micro-batches per step (the global batch [B, T] is cut into m micro-batches [B/m, T]), v model chunks per rank
(interleaved schedule), F a forward of one micro-batch through one stage, B its backward (BI + BW in zero bubble).

Stage s holds a contiguous run of transformer blocks; stage 0 also holds the embeddings, the last stage the final
LayerNorm, the LM head and the loss. A forward sends the activation [B/m, T, H] to the next stage's rank; a
backward sends the activation's gradient [B/m, T, H] to the previous stage's rank.

What each rank runs, and in which order, is a schedule: plain data, built, simulated and checked in
parlab/schemes/pipeline/schedules.py (GPipe, 1F1B, interleaved 1F1B, ZB-H1, with their exact ideal bubbles) and
parlab/schemes/pipeline/schedules_v.py (ZB-V, DualPipeV: two stages per rank in a V). This file runs a
schedule on real ranks: `run_step` is one small executor that receives what each action needs, computes it inside
a `comm.span`, and sends what it produced; `train_pipeline` is the training loop around it. Both work within a
pipeline process group (default: all ranks), so that on a device mesh several pipelines run side by side.
The lesson's figures and tables are in parlab/lessons/pipeline.py; `python -m parlab run pp` runs and checks it
(parlab/runs/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parlab.core import comm
from parlab.core.memory import saved_activations
from parlab.core.models import GPT, GPTConfig, lm_loss
from parlab.core.trace import Trace
from parlab.schemes.pipeline.actions import SPAN_KIND, Action, Schedule
from parlab.schemes.pipeline.schedules import messages

# ------------------------------------------------------------------------------------ partitioning the model


def split_layers(layers: int, stages: int, split: Sequence[int] | None = None) -> list[range]:
    """The blocks each stage holds: stage s runs blocks ranges[s]. Even by default, or `split` blocks per stage.

    layers=8, stages=4 -> [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    """
    if split is None:
        if layers % stages:
            raise ValueError(f"layers={layers} is not divisible by stages={stages} (p x v); give an explicit split")
        split = [layers // stages] * stages
    split = list(split)
    if len(split) != stages:
        raise ValueError(f"split {split} has {len(split)} entries, but there are {stages} stages (p x v)")
    if sum(split) != layers:
        raise ValueError(f"split {split} adds up to {sum(split)} blocks, but the model has layers={layers}")
    if min(split) < 0:
        raise ValueError(f"split {split} has a negative entry")
    starts = [sum(split[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, split, strict=True)]


class Stage(nn.Module):
    """One pipeline stage: blocks `layers` of the reference GPT (its very modules, so names and values match).

    Stage 0 also embeds: input idx [b, T] (token ids) -> [b, T, H]. Other stages take [b, T, H].
    The last stage also applies ln_f and lm_head: output logits [b, T, V]. Other stages output [b, T, H].
    loss_fn(logits, targets): the last stage's mean loss over a micro-batch (default: lm_loss). `model` may also be
    a TensorParallelGPT (same module names): then each stage holds this rank's TP slices of its blocks, and its
    loss is the vocab-parallel one (TensorParallelGPT.loss_from_logits).
    """

    def __init__(self, model: GPT, index: int, num_stages: int, layers: range, loss_fn=lm_loss):
        super().__init__()
        self.cfg, self.loss_fn = model.cfg, loss_fn
        self.index, self.first, self.last, self.layers = index, index == 0, index == num_stages - 1, layers
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        self.embedding = nn.ModuleDict({"wte": model.wte, "wpe": model.wpe}) if self.first else None
        self.output = nn.ModuleDict({"ln_f": model.ln_f, "lm_head": model.lm_head}) if self.last else None
        # The reference model's names of the parameters held here ("blocks.3.mlp.fc.weight", "wte.weight", ...).
        prefixes = tuple(f"blocks.{i}." for i in layers)
        prefixes += ("wte.", "wpe.") if self.first else ()
        prefixes += ("ln_f.", "lm_head.") if self.last else ()
        self.named = {name: p for name, p in model.named_parameters() if name.startswith(prefixes)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # [b, T] token ids -> [b, T, H]
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embedding["wte"](x) + self.embedding["wpe"](positions)
        for block in self.blocks:
            x = block(x)  # [b, T, H]
        if self.last:
            x = self.output["lm_head"](self.output["ln_f"](x))  # [b, T, V]
        return x


# ---------------------------------------------------------------------------------------------- the executor


@dataclass
class InFlight:
    """What a rank holds for one (micro-batch, chunk) between its F and its last backward action."""

    inp: torch.Tensor  # the stage input: [b, T] token ids on stage 0, else the received activation [b, T, H]
    out: torch.Tensor  # the stage output [b, T, H] (sent on), or on the last stage the scaled loss (a scalar)
    saved_bytes: int  # bytes of the activations autograd saved for the backward (measured, parlab.core.memory)
    module_outputs: list = field(default_factory=list)  # zero bubble: (output, its module's weights) per module
    output_grads: tuple = ()  # zero bubble: d loss / d output of each of those modules, from BI, for BW


@dataclass
class StepStats:
    peak_inflight: int = 0  # most (micro-batch, chunk) activation sets held at once
    peak_activation_bytes: int = 0  # most bytes of saved activations held at once
    loss: float = 0.0  # sum over micro-batches of loss_i / m = the global batch's mean loss (last stage only)


@dataclass(frozen=True)
class Boundary:
    """What crosses a stage boundary: an activation (and its gradient) of [b, T, width] numbers of `dtype`.

    The plain pipeline sends [b, T, H] (`Boundary.of(cfg)`); with Megatron SP a hybrid stage sends its T/tp tokens
    [b, T/tp, H], the same count as [b, T, H/tp] (parlab/schemes/hybrid/stage.py)."""

    width: int
    dtype: torch.dtype

    @staticmethod
    def of(cfg: GPTConfig) -> Boundary:
        return Boundary(cfg.hidden, cfg.torch_dtype)


class _Step:
    """One training step on one rank: what its actions share (the micro-batches, the activations held between an
    F and its last backward action, the sends in flight), and one method per kind of action."""

    def __init__(self, schedule: Schedule, stages: dict[int, Stage], boundary: Boundary, x, y, step, grad_group, group):
        self.schedule, self.stages, self.boundary, self.step = schedule, stages, boundary, step
        self.group, self.grad_group = group, group if grad_group is None else grad_group
        self.rank, self.last = comm.group_rank(group), schedule.num_stages - 1
        self.me = comm.global_rank(group, self.rank)
        self.xs, self.ys = x.chunk(schedule.m), y.chunk(schedule.m)  # m micro-batches of [b, T], b = B/m
        self.weights = [w for stage in stages.values() for w in stage.parameters()]  # not activations
        self.held: dict[tuple[int, int], InFlight] = {}
        self.sends = []  # asynchronous sends, waited for at the end of the step
        # The tip of a V (parlab/schemes/pipeline/schedules_v.py): stages p-1 and p live on the same rank, which
        # hands the activation (and the gradient back) from one to the other in memory, keyed (kind, mb, receiving
        # stage): no message.
        self.local = {}
        self.split_backward = any(a.op == "BI" for a in schedule.actions[self.rank])
        self.stats = StepStats()

    def peer(self, s: int) -> int:
        """The global rank that holds virtual stage s of this pipeline."""
        return comm.global_rank(self.group, self.schedule.rank_of(s))

    def receive(self, kind: str, mb: int, s: int, src: int, buffer, group, tag: str) -> torch.Tensor:
        """What stage `src` sends stage s: from this rank's other chunk in memory, or received into `buffer`."""
        if self.peer(src) == self.me:
            return self.local.pop((kind, mb, s))
        comm.recv(buffer, src=self.peer(src), group=group, label=tag)
        return buffer

    def pass_on(self, kind: str, mb: int, dst: int, tensor: torch.Tensor, group, tag: str) -> None:
        """Hand `tensor` to stage `dst`: in memory if this rank holds it too, else an asynchronous send."""
        if self.peer(dst) == self.me:
            self.local[(kind, mb, dst)] = tensor
        else:
            self.sends.append(comm.isend(tensor, dst=self.peer(dst), group=group, label=tag))

    def forward(self, a: Action) -> None:
        """F: receive the stage input (token ids on stage 0), run the stage, send its output on (or, on the last
        stage, take the loss); keep what the backward will need."""
        s, stage, tag = self.schedule.stage(self.rank, a.chunk), self.stages[a.chunk], a.label(self.schedule.v)
        if s == 0:
            inp = self.xs[a.mb]  # [b, T] token ids
        else:  # the activation of stage s-1: [b, T, H]
            b, T = self.xs[a.mb].shape
            buffer = torch.empty(b, T, self.boundary.width, dtype=self.boundary.dtype, device=self.xs[a.mb].device)
            inp = self.receive("act", a.mb, s, s - 1, buffer, self.group, tag).requires_grad_()
        captured: list = []
        hooks = _capture_module_outputs(stage, captured) if self.split_backward else []
        with comm.span(tag, kind="forward", mb=a.mb, chunk=a.chunk, step=self.step):
            with saved_activations(self.weights) as saved:
                out = stage(inp)  # [b, T, H], or logits [b, T, V] on the last stage
                if s == self.last:
                    out = stage.loss_fn(out, self.ys[a.mb]) / self.schedule.m  # the m losses add up to the mean
        for h in hooks:
            h.remove()
        if s == self.last:
            self.stats.loss += out.item()
        else:
            self.pass_on("act", a.mb, s + 1, out.detach(), self.group, tag)
        self.held[(a.mb, a.chunk)] = InFlight(inp, out, saved.bytes, captured)
        self.stats.peak_inflight = max(self.stats.peak_inflight, len(self.held))
        held_bytes = sum(h.saved_bytes for h in self.held.values())
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, held_bytes)

    def backward(self, a: Action) -> None:
        """B (input and weight gradients) or BI (input gradient only, and each module's output gradient for BW):
        receive d loss / d output from stage s+1 (the loss itself starts the last stage's), send d loss / d input
        back to stage s-1."""
        s, tag = self.schedule.stage(self.rank, a.chunk), a.label(self.schedule.v)
        entry = self.held[(a.mb, a.chunk)]
        grad = None  # on the last stage the loss itself starts the backward
        if s < self.last:  # d loss / d output of this stage: [b, T, H]
            grad = self.receive("grad", a.mb, s, s + 1, torch.empty_like(entry.out), self.grad_group, tag)
        with comm.span(tag, kind=SPAN_KIND[a.op], mb=a.mb, chunk=a.chunk, step=self.step):
            if a.op == "B":  # the whole backward: input gradient and weight gradients (into .grad)
                torch.autograd.backward(entry.out, grad)
                input_grad = entry.inp.grad if s > 0 else None
            else:  # BI: only the gradients w.r.t. the stage input and w.r.t. each module's output
                targets = ([entry.inp] if s > 0 else []) + [o for o, _ in entry.module_outputs]
                grads = torch.autograd.grad(entry.out, targets, grad, retain_graph=True)
                input_grad = grads[0] if s > 0 else None
                entry.output_grads = grads[1:] if s > 0 else grads
        if s > 0:
            self.pass_on("grad", a.mb, s - 1, input_grad, self.grad_group, tag)
        if a.op == "B":
            del self.held[(a.mb, a.chunk)]

    def weight_backward(self, a: Action) -> None:
        """BW: d loss / d W of each module from d loss / d (its output), kept by BI; touches only the weights."""
        entry = self.held.pop((a.mb, a.chunk))
        with comm.span(a.label(self.schedule.v), kind="backward_weight", mb=a.mb, chunk=a.chunk, step=self.step):
            for (output, params), g in zip(entry.module_outputs, entry.output_grads, strict=True):
                torch.autograd.backward(output, g, inputs=params)


def run_step(
    schedule: Schedule,
    stages: dict[int, Stage],
    boundary: Boundary,
    x: torch.Tensor,
    y: torch.Tensor,
    step: int,
    grad_group=None,
    group=None,
) -> StepStats:
    """Run one training step's forwards and backwards on this rank, in the order schedule.actions[rank] says.

    group: the pipeline's ranks (default all); rank = this process's rank in it. grad_group: a second group of
    the same ranks, for the gradients (default: the same group).
    stages: this rank's stages, by chunk (chunk k is stage schedule.stage(rank, k): k p + rank, or in a V 2p-1-rank).
    boundary: what a stage sends on (Boundary.of(cfg): [b, T, H] in the model's dtype).
    x, y: the global batch [B, T]; micro-batch i is rows [i B/m, (i+1) B/m).
    Gradients accumulate in the stages' .grad over the m micro-batches (each loss is scaled by 1/m, so they sum to
    the global batch's mean-loss gradient). Activations travel on `group`, their gradients on `grad_group`, so
    the two kinds never queue behind each other between the same two ranks.
    """
    run = _Step(schedule, stages, boundary, x, y, step, grad_group, group)
    actions = {"F": run.forward, "B": run.backward, "BI": run.backward, "BW": run.weight_backward}
    for a in schedule.actions[run.rank]:
        actions[a.op](a)
    comm.wait_all(run.sends)
    return run.stats


def _capture_module_outputs(stage: Stage, captured: list) -> list:
    """Zero bubble: record the output of every module that owns weights (Linear, LayerNorm, Embedding) during the
    forward, with those weights, so BW can later turn d loss / d output into d loss / d weights."""

    def hook(module, _inputs, output):
        captured.append((output, list(module.parameters(recurse=False))))

    return [
        module.register_forward_hook(hook)
        for module in stage.modules()
        if any(True for _ in module.parameters(recurse=False))
    ]


# ------------------------------------------------------------------------------------------ the training run


def build_stages(
    model: GPT, schedule: Schedule, rank: int, split: Sequence[int] | None = None, loss_fn=lm_loss
) -> dict[int, Stage]:
    """Pipeline rank `rank`'s stages, by chunk: chunk k is stage schedule.stage(rank, k) (blocks from `split`)."""
    layer_ranges = split_layers(model.cfg.layers, schedule.num_stages, split)
    stages = {}
    for k in range(schedule.v):
        s = schedule.stage(rank, k)
        stages[k] = Stage(model, s, schedule.num_stages, layer_ranges[s], loss_fn)
    return stages


def train_pipeline(
    schedule: Schedule,
    stages: dict[int, Stage],
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    group=None,
    grad_group=None,
    grad_sync: Callable[[], None] | None = None,
) -> dict:
    """Rank code: train `steps = len(batches)` steps with the schedule; return what the check needs.

    batches: the batches [B, T] this pipeline trains on, the same on every rank of the pipeline. grad_sync: called
    after each step's backward passes, before the optimizer: e.g. data parallelism's all-reduce of the stages'
    gradients over a "dp" axis, when several pipelines train replicas of the model. Returns the losses (on the rank
    holding the last stage; None elsewhere), the first step's gradients and the final parameters of this rank's
    stages (by the reference model's names), and the activations held at the peak (count and bytes).
    """
    rank, cfg = comm.group_rank(group), next(iter(stages.values())).cfg
    named = {name: w for stage in stages.values() for name, w in stage.named.items()}
    losses, first_grads, stats = [], {}, []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        stats.append(run_step(schedule, stages, Boundary.of(cfg), x, y, step, grad_group, group))
        if grad_sync is not None:
            grad_sync()
        if step == 0:
            first_grads = {name: w.grad.detach().clone() for name, w in named.items()}
        with comm.span("optimizer step", kind="optimizer", step=step):
            optimizer.step()
        losses.append(stats[-1].loss)
        comm.progress(step + 1, len(batches))
    holds_last = schedule.rank_of(schedule.num_stages - 1) == rank
    return {
        "losses": losses if holds_last else None,
        "grads": first_grads,
        "params": {name: w.detach().clone() for name, w in named.items()},
        "peak_inflight": max(s.peak_inflight for s in stats),
        "peak_activation_bytes": max(s.peak_activation_bytes for s in stats),
    }


# ------------------------------------------------------------------------------------ the theory, and measured


def theory_send_bytes(schedule: Schedule, message_bytes: int, steps: int = 1) -> list[int]:
    """Bytes each pipeline rank sends in `steps` steps: one activation or gradient message of `message_bytes`
    ([b, T, H]) per F not on the last stage and per B (or BI) not on stage 0."""
    sends = [0] * schedule.p
    for (src, _dst, _kind), (sent, _received) in messages(schedule).items():
        sends[src] += len(sent)
    return [n * message_bytes * steps for n in sends]


def measured_bubble(trace: Trace, step: int | None = None) -> tuple[float, list[float]]:
    """Idle fraction of the ranks' compute in one step (default: the last), from their recorded spans.

    T = from the step's first F/B span's start to its last one's end over all ranks; rank r's bubble = (T - its
    busy time) / T; returns the mean over ranks and the per-rank list. (The optimizer step is not counted.)
    """
    step = trace.last_step() if step is None else step
    spans = [e for e in trace.of_step(step).events if e.kind in SPAN_KIND.values()]
    t0, t1 = min(e.start for e in spans), max(e.end for e in spans)
    per_rank = [1 - sum(e.duration for e in spans if e.rank == r) / (t1 - t0) for r in range(trace.world_size)]
    return sum(per_rank) / len(per_rank), per_rank
