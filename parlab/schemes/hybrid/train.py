"""Hybrid parallelism: any set of dp, cp, tp, pp on one device mesh, each scheme on its own axis.

Large models train with several schemes at once (Megatron-LM's "3D parallelism", Narayanan et al. 2021; with
context parallelism, torchtitan's 4D). On dp x pp x cp x tp ranks arranged as a mesh with axes ("dp", "pp",
"cp", "tp"), the last axis fastest (TP partners are neighbours: on a real cluster the fast links of one node),
each rank takes part in one group per axis, and every scheme talks only within its own:

    tp  the same stage, replica and tokens: each holds 1/tp of the stage's big matrices
    (parlab/schemes/tensor_parallel.py)
        and all-reduces [b, T/cp, H] twice per block forward and twice backward (Megatron's g and f); with
        sequence parallelism (parlab/schemes/sequence/sequence_parallel.py) all-gathers and reduce-scatters along the
        sequence
    cp  the same stage, replica and slice: each holds T/cp tokens of every sequence; attention passes K/V round a
        ring (parlab/schemes/sequence/ring_attention.py, contiguous or zigzag) or trades the sequence split for a head
        split by all-to-alls (parlab/schemes/sequence/ulysses.py)
    pp  the same replica, tokens and slice: each holds the blocks of its stage(s) and sends [b, T/cp, H] on per
        micro-batch and hop (parlab/schemes/pipeline/executor.py runs any schedule of
        parlab/schemes/pipeline/schedules.py)
    dp  the same stage, tokens and slice: each trains on B/dp rows; the gradients are averaged over dp x cp
        (the cp ranks saw other tokens of the same rows), with ZeRO 1, 2 or 3 (parlab/schemes/zero/stages.py) sharding
        the optimizer states, gradients and parameters over that flattened "dp_cp" group (torchtitan's dp_shard_cp)
    ep  ranks borrowed from dp x cp (an MoE GPT): each of an ep group's ranks holds E/ep experts of every MoE
        layer and sends its tokens to them by all-to-all; USP splits cp itself into ring x ulysses sub-axes
        (both in parlab/schemes/hybrid/experts.py, which says how and why)

The building blocks are the very ones of the single schemes, composed in parlab/schemes/hybrid/stage.py; composing them
is a matter of handing each the right process group. `check_parallel_dims` below refuses, before any process
starts, every combination that cannot run, and says why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from parlab.core import comm
from parlab.core.memory import state_bytes
from parlab.core.mesh import DeviceMesh
from parlab.core.models import GPT, GPTConfig, make_optimizer
from parlab.schemes.data_parallel import all_reduce_gradients, shard_batch
from parlab.schemes.hybrid.experts import (
    block_numels,
    check_experts,
    check_usp_axis,
    drain_moe_stats,
    expert_groups,
    is_moe_block,
    moe_modules,
    sync_expert_gradients,
    usp_sizes,
)
from parlab.schemes.hybrid.stage import (
    CP_METHODS,
    Axes,
    HybridStage,
    PipelineZeRO,
    sequence_split_params,
    sp_grad_hooks,
    sp_grad_sync,
)
from parlab.schemes.pipeline.actions import Schedule
from parlab.schemes.pipeline.executor import run_step, split_layers, theory_send_bytes
from parlab.schemes.pipeline.schedules import check_schedule_args
from parlab.schemes.sequence.ring_attention import kv_block_bytes, sequence_split
from parlab.schemes.sequence.ulysses import a2a_bytes_per_call
from parlab.schemes.sequence.usp import usp_bytes_per_call
from parlab.schemes.zero.stages import ZeRO

AXES = ("dp", "pp", "cp", "tp")  # the mesh's order: tp fastest
ZERO_STAGES = (0, 1, 2, 3)


def check_parallel_dims(
    cfg: GPTConfig,
    sizes: dict[str, int],
    *,
    world_size: int,
    batch: int,
    microbatches: int,
    schedule: str = "1f1b",
    virtual: int = 1,
    zero: int = 0,
    sequence_parallel: bool = False,
    cp_method: str = "ring",
    optimizer: str = "sgd",
    ulysses: int = 1,
) -> None:
    """Raise a ValueError naming the first combination of axes and options that cannot run, and why.

    sizes: {"dp": D, "pp": S, "cp": C, "tp": T, "ep": P} (a missing axis has size 1; ep is no axis of its own but
    splits dp x cp, see parlab/schemes/hybrid/experts.py). What each size must divide:

        axis  size  must divide / needs                              because
        ----  ----  -----------------------------------------------  ------------------------------------------
        all   >= 1  D x S x C x T = world_size                       one rank per place of the mesh
        dp    D     batch, and batch / D by m                        each replica runs m equal micro-batches
        pp    S     layers by S x v (v chunks per rank), m as the    each stage holds whole blocks; the
                    schedule needs (1F1B: m >= S); untied head       embedding and the LM head sit on
                                                                     different stages
        cp    C     T by C (zigzag: by 2C); Ulysses: nh / T by C     each rank holds whole chunks of tokens;
                                                                     Ulysses gives each cp rank whole heads
        tp    T     nh, H, F and V by T                              each rank holds whole heads, FFN columns
                                                                     and vocabulary rows
        SP    T>1   T / C by T                                       SP splits the tp group's tokens again
        ZeRO  z     D x C > 1; Adam; z = 3: no zb-type schedule       it shards over dp x cp with its own Adam;
                    (BI/BW split) and no tied head                   a later forward frees what BW still needs
        USP   U     U divides C and nh / T (ring R = C / U)          a ulysses group's ranks get whole heads
        ep    P     P divides D x C and E; MoE layers; no SP, no     ep groups are cut from dp x cp; SP would
                    ZeRO                                             give each tp rank other tokens; ZeRO's
                                                                     units would mix groups of ranks
    """
    ep = sizes.get("ep", 1)
    sizes = {axis: sizes.get(axis, 1) for axis in AXES}
    _check_mesh_shape(sizes, ep, world_size)
    D, S, C, T = (sizes[a] for a in ("dp", "pp", "cp", "tp"))
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if batch % D or (batch // D) % microbatches:
        raise ValueError(
            f"batch={batch} must split into dp={D} replicas of microbatches={microbatches} equal micro-batches"
        )
    check_schedule_args(schedule, S, microbatches, virtual)
    if cfg.layers % (S * virtual):
        raise ValueError(f"layers={cfg.layers} is not divisible by pp={S} x v={virtual} (blocks per pipeline stage)")
    if cfg.tied and S > 1:
        raise ValueError("a tied embedding and LM head live on different pipeline stages: use pp=1 or untied")
    for name, n in (("heads", cfg.heads), ("hidden", cfg.hidden), ("ffn", cfg.ffn), ("vocab", cfg.vocab_size)):
        if n % T:
            raise ValueError(f"the tp axis (tp={T}): {name}={n} is not divisible by tp={T}")
    _check_sequence_split(cfg, sizes, cp_method, ulysses, sequence_parallel)
    _check_zero(cfg, zero, D, C, optimizer, schedule)
    check_experts(cfg, {**sizes, "ep": ep}, zero=zero, sequence_parallel=sequence_parallel)


def _check_mesh_shape(sizes: dict[str, int], ep: int, world_size: int) -> None:
    """Every axis a positive int, and one rank per place of the mesh."""
    for axis, n in (*sizes.items(), ("ep", ep)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{axis}={n} must be >= 1")
    if math.prod(sizes.values()) != world_size:
        shape = " x ".join(f"{a}={n}" for a, n in sizes.items())
        raise ValueError(f"mesh {shape} = {math.prod(sizes.values())} ranks, but world_size={world_size}")


def _check_sequence_split(cfg: GPTConfig, sizes: dict[str, int], cp_method: str, ulysses: int, sp: bool) -> None:
    """The cp axis (and USP's sub-axes) and Megatron SP: whole chunks of tokens and whole heads for every rank."""
    C, T = sizes["cp"], sizes["tp"]
    if cp_method not in CP_METHODS:
        raise ValueError(f"cp_method={cp_method!r} must be one of {', '.join(CP_METHODS)}")
    chunks = 2 * C if cp_method == "zigzag" and C > 1 else C
    if cfg.seq_len % chunks:
        raise ValueError(f"the cp axis (cp={C}, {cp_method}): seq={cfg.seq_len} is not divisible by {chunks} chunks")
    if cp_method == "ulysses" and (cfg.heads // T) % C:
        raise ValueError(
            f"the cp axis (Ulysses, cp={C}): each cp rank needs whole heads, but heads / tp = {cfg.heads // T} "
            f"is not divisible by cp={C} (use --cp-method ring)"
        )
    check_usp_axis(cfg, sizes, ulysses, cp_method)
    if sp and T < 2:
        raise ValueError(f"sequence_parallel needs tp>=2 (got tp={T}): Megatron SP splits the tp group's activations")
    if sp and (cfg.seq_len // C) % T:
        raise ValueError(f"sequence_parallel: the {cfg.seq_len // C} tokens of a cp rank do not split into tp={T}")


def _check_zero(cfg: GPTConfig, zero: int, D: int, C: int, optimizer: str, schedule: str) -> None:
    """ZeRO over the D x C ranks of dp x cp: more than one, its own Adam, and (stage 3) what BW still needs kept."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero} must be one of {ZERO_STAGES}")
    if zero and D * C == 1:
        raise ValueError(f"zero={zero} shards over the dp x cp ranks, and there is only one (dp={D}, cp={C})")
    if zero and optimizer != "adam":
        raise ValueError(f"zero={zero} steps with ZeRO's own Adam: add --optimizer adam (and a smaller --lr)")
    if zero == 3 and schedule in ("zb", "zbv", "dualpipev"):
        raise ValueError(
            f"zero=3 with schedule {schedule!r}: its weight-gradient pass (BW) runs after a later forward has freed "
            "the layer's gathered parameters (use 1f1b, gpipe or interleaved, or zero 2)"
        )
    if zero == 3 and cfg.tied:
        raise ValueError("zero=3 with a tied LM head: the head would use the embedding's freed parameters; untie it")


# --------------------------------------------------------------------------------------------- the rank loop


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    return mesh.axes.get(axis, 1)


def gradient_group(mesh: DeviceMesh):
    """The group whose ranks hold the same weights: dp, or dp x cp flattened when the sequence is split too."""
    if axis_size(mesh, "cp") == 1:
        return mesh.group("dp")
    return mesh.flatten("dp", "cp")


def mesh_axes(mesh: DeviceMesh, sequence_parallel: bool, cp_method: str, ulysses: int = 1, ep_group=None) -> Axes:
    """This rank's tp and cp groups and places (an axis the mesh lacks has size 1); with USP the cp group's ring
    and ulysses sub-groups (cp rank = ring index x U + ulysses index). Collective."""
    tp, cp = axis_size(mesh, "tp"), axis_size(mesh, "cp")
    ring_group = ulysses_group = None
    if cp_method == "usp" and cp > 1:
        ring_group, ulysses_group = mesh.unflatten(("cp",), ulysses, ("ring", "ulysses"))
    return Axes(
        tp=tp,
        cp=cp,
        tp_group=mesh.group("tp") if tp > 1 else None,
        cp_group=mesh.group("cp") if cp > 1 else None,
        tp_rank=mesh.index("tp") if tp > 1 else 0,
        cp_rank=mesh.index("cp") if cp > 1 else 0,
        sequence_parallel=sequence_parallel,
        cp_method=cp_method,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        ep_group=ep_group,
    )


def stage_layers(cfg: GPTConfig, schedule: Schedule, pp_rank: int, split=None) -> list[tuple[int, range]]:
    """(virtual stage, its blocks) of each chunk pipeline rank `pp_rank` holds."""
    ranges = split_layers(cfg.layers, schedule.num_stages, split)
    return [(s, ranges[s]) for s in (schedule.stage(pp_rank, k) for k in range(schedule.v))]


def hybrid_stages(model: GPT, schedule: Schedule, pp_rank: int, axes: Axes, split=None) -> dict[int, HybridStage]:
    """This rank's pipeline stages by chunk (chunk k is virtual stage k p + pp_rank), each with its tp slices."""
    held = stage_layers(model.cfg, schedule, pp_rank, split)
    return {k: HybridStage(model, s, schedule.num_stages, layers, axes) for k, (s, layers) in enumerate(held)}


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
    cp_method: str = "ring",
    ulysses: int = 1,
    ep: int = 1,
) -> dict:
    """Rank code: train the GPT on `mesh` (axes dp and pp, and any of cp, tp) with `schedule` over pp.

    model: the full reference model (the same on every rank: each keeps its slices of its stages).
    batches: the global batches [B, T], the same on every rank: replica dp takes rows [dp B/D, (dp+1) B/D), of
    those its cp block of tokens [B/D, T/C], which the pipeline cuts into m micro-batches.
    zero_stage 1-3: ZeRO over dp x cp with its own Adam (optimizer must be "adam"); else `optimizer` with the
    gradients averaged over dp x cp. sequence_parallel: Megatron SP on tp. cp_method: ring, zigzag, ulysses or
    usp (`ulysses` ranks of cp on its ulysses sub-axis). ep: an MoE GPT's experts over ep groups cut from dp x cp
    (non-expert gradients averaged over dp x cp, expert ones over the edp group); "moe" then holds, per step, what
    its MoE layers saw (aux losses, drops, load, the ep all-to-alls' rows).
    Returns the losses (mean over this rank's tokens, last stage only), the first step's gradients (or, with ZeRO,
    this rank's shard of their sum and the units' layout), the final parameters (reference names, tp slices),
    and the bytes this rank holds.
    """
    rank = HybridRank(
        model, mesh, schedule, optimizer, lr, split, zero_stage, sequence_parallel, cp_method, ulysses, ep
    )
    losses, first, peak, moe_steps = [], {}, 0, []
    for step, (x, y) in enumerate(rank.rows(batches)):  # this rank's rows [B/D, T/C] of each global batch
        rank.zero_grad()
        stats = run_step(schedule, rank.stages, rank.boundary, x, y, step, rank.grad_channel, rank.pp_group)  # pp
        rank.sync_gradients()  # tp (SP's LayerNorms), dp x cp (or ZeRO's reduce-scatters), edp for the experts
        if step == 0:
            first = rank.gradients(after_step=False)
        with comm.span("optimizer step", kind="optimizer", step=step):
            rank.optimizer_step(step)
        if step == 0:
            first |= rank.gradients(after_step=True)
        losses.append(stats.loss)
        peak = max(peak, stats.peak_activation_bytes)
        moe_steps.append(drain_moe_stats(rank.moes))
        comm.progress(step + 1, len(batches))
    return rank.collect(losses, first, peak, moe_steps)


class HybridRank:
    """One rank of train_hybrid: its stages (its tp slices of its pp stages), its groups on the mesh, and its
    optimizer (ZeRO over dp x cp, or a plain one with the gradients averaged there)."""

    def __init__(
        self, model, mesh, schedule, optimizer, lr, split, zero_stage, sequence_parallel, cp_method, ulysses, ep
    ):
        self.mesh, self.schedule, self.zero_stage, self.ep = mesh, schedule, zero_stage, ep
        self.edp_group, ep_group = expert_groups(mesh, ep) if ep > 1 else (None, None)
        self.axes = mesh_axes(mesh, sequence_parallel, cp_method, ulysses, ep_group)
        self.stages = hybrid_stages(model, schedule, mesh.index("pp"), self.axes, split)
        self.layers = nn.ModuleList(m for stage in self.stages.values() for m in stage.layer_modules())  # ZeRO's units
        self.name_of = {id(p): n for stage in self.stages.values() for n, p in stage.named.items()}
        self.group = gradient_group(mesh)  # the ranks holding the same weights: dp (x cp)
        self.moes, self.N = moe_modules(self.layers), comm.group_size(self.group)
        for layer in self.moes:  # each micro-batch's loss is scaled by 1/m in the pipeline: its aux losses too
            layer.aux_scale = layer.cfg.aux_weight / schedule.m
        if ep > 1 and comm.group_size(self.edp_group) == 1:
            self.edp_group = None  # every expert on one rank of dp x cp: nothing to average
        self.sp_params = sequence_split_params(self.layers) if sequence_parallel else []
        with_zero = self.sp_params and zero_stage >= 2  # SP's sum must run before ZeRO's hooks take the gradients
        self.hooks = sp_grad_hooks(self.sp_params, self.axes.tp_group) if with_zero else []
        if zero_stage:
            self.zero = (ZeRO if zero_stage == 1 else PipelineZeRO)(self.layers, zero_stage, lr=lr, group=self.group)
        else:
            self.opt = make_optimizer(self.layers.parameters(), optimizer, lr)
        self.pp_group, self.grad_channel = mesh.group("pp"), mesh.twin_group("pp")
        self.boundary = next(iter(self.stages.values())).boundary

    def rows(self, batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This replica's rows [B/D, T] of each global batch, and of them this rank's cp block of tokens."""
        rows = []
        for x, y in batches:
            x, y = shard_batch(x, y, self.mesh.index("dp"), axis_size(self.mesh, "dp"))
            a = self.axes
            rows.append(tuple(sequence_split(t, a.cp_rank, a.cp, dim=1, layout=a.layout) for t in (x, y)))
        return rows

    def zero_grad(self) -> None:
        self.zero.zero_grad() if self.zero_stage else self.opt.zero_grad(set_to_none=True)

    def sync_gradients(self) -> None:
        """After the step's backwards: every gradient summed or averaged over the ranks that share its weights."""
        if self.sp_params and self.zero_stage < 2:  # SP's LayerNorm gradients: partial sums over tp
            sp_grad_sync(self.sp_params, self.axes.tp_group)
        if self.zero_stage >= 2:
            self.zero.finish_backward()  # every unit's reduce-scatter arrived
        elif self.ep > 1:  # dense gradients over dp x cp, expert ones over the ranks holding the same experts
            sync_expert_gradients(self.layers, self.group, self.edp_group, self.N)
        elif not self.zero_stage and self.N > 1:
            all_reduce_gradients(self.layers, group=self.group)  # the average over the replicas (and the cp ranks)

    def optimizer_step(self, step: int) -> None:
        self.zero.step(step) if self.zero_stage else self.opt.step()

    def gradients(self, after_step: bool) -> dict:
        """What the check compares of the first step: the gradients (reference names, tp slices), or with ZeRO
        this rank's shard of their sum over the group. ZeRO-1 reduce-scatters inside its step: its shard is read
        after it, every other one before."""
        if after_step != (self.zero_stage == 1):
            return {}
        if self.zero_stage == 1:  # shard r of the flat gradients, summed over the group in place
            return {"grad_shard": torch.cat([u.shard_of(u.grad_flat, self.zero.rank) for u in self.zero.units]).clone()}
        if self.zero_stage >= 2:
            return {"grad_shard": self.zero.grad_shard.clone()}
        return {"grads": {self.name_of[id(p)]: p.grad.detach().clone() for p in self.layers.parameters()}}

    def collect(self, losses, first, peak, moe_steps) -> dict:
        """The run's result: losses (on the rank of the last stage), the first step's gradients, the final
        parameters (reference names), the units' layout under ZeRO, and the bytes this rank holds."""
        for hook in self.hooks:
            hook.remove()
        name_of, out = self.name_of, dict(first)
        if self.zero_stage:
            full = self.zero.full_params()  # a check's gather of the master shards (labelled "check: ...")
            by_unit = {n: p for u in self.zero.units for n, p in zip(u.names, u.params, strict=True)}
            out["params"] = {name_of[id(by_unit[n])]: w for n, w in full.items()}
            out["units"] = [
                ([name_of[id(p)] for p in u.params], [tuple(p.shape) for p in u.params], u.offset, u.shard_numel)
                for u in self.zero.units
            ]
            held = self.zero.held()
            self.zero.remove()
        else:
            out["params"] = {name_of[id(p)]: p.detach().clone() for p in self.layers.parameters()}
            held = state_bytes(self.layers, self.opt)
        holds_last = self.schedule.rank_of(self.schedule.num_stages - 1) == self.mesh.index("pp")
        return {
            **out,
            "losses": losses if holds_last else None,
            "split_dims": {name_of[id(p)]: p.tp_split_dim for p in self.layers.parameters()},
            "coords": self.mesh.coords,
            "param_bytes": held["params"],  # measured from the tensors this rank holds (ZeRO: its flat buffers)
            "state_bytes": {k: held[k] for k in ("params", "grads", "optimizer")},
            "peak_activation_bytes": peak,
            "moe": moe_steps,
        }


def unshard(shards: list[torch.Tensor], units: list) -> dict[str, torch.Tensor]:
    """Every parameter's tensor from the group's flat ZeRO shards (shards[q]: rank q's [S]; no communication)."""
    out = {}
    for names, shapes, offset, S in units:
        flat = torch.cat([shard[offset : offset + S] for shard in shards])  # the unit's [N*S_u]
        start = 0
        for name, shape in zip(names, shapes, strict=True):
            out[name] = flat[start : start + math.prod(shape)].view(shape)
            start += math.prod(shape)
    return out


# ------------------------------------------------------------------------------------------------- the theory


def unit_numels(cfg: GPTConfig, schedule: Schedule, pp_rank: int, tp: int, split=None, ep: int = 1) -> list[int]:
    """Numbers one rank holds of each layer (ZeRO's units) of its stages: TP-split matrices / tp, the rest whole;
    an MoE block its router and E/ep experts (parlab/schemes/hybrid/experts.py's block_numels)."""
    H, V, T = cfg.hidden, cfg.vocab_size, cfg.seq_len
    last_stage = schedule.num_stages - 1
    units = []
    for s, layers in stage_layers(cfg, schedule, pp_rank, split):
        units += [V * H // tp, T * H] if s == 0 else []  # wte (vocab-parallel), wpe
        units += [sum(block_numels(cfg, i, tp, ep)) for i in layers]
        units += ([2 * H] + ([] if cfg.tied else [V * H // tp])) if s == last_stage else []  # ln_f, lm_head
    return units


def hybrid_param_bytes(cfg: GPTConfig, schedule: Schedule, pp_rank: int, sizes: dict, zero: int, split=None) -> int:
    """Parameter bytes a rank of pipeline rank `pp_rank` holds: its layers' tp slices; ZeRO 1-2 keep them in flat
    buffers padded to N x S_u (N = dp x cp); ZeRO-3 only its shard S_u of each."""
    units = unit_numels(cfg, schedule, pp_rank, sizes["tp"], split, sizes.get("ep", 1))
    N = sizes["dp"] * sizes["cp"]
    shards = [math.ceil(n / N) for n in units]
    held = {0: sum(units), 1: N * sum(shards), 2: N * sum(shards), 3: sum(shards)}[zero]
    return held * cfg.dtype_bytes


def hybrid_comm_theory(
    cfg: GPTConfig,
    schedule: Schedule,
    batch: int,
    sizes: dict[str, int],
    *,
    zero: int = 0,
    sequence_parallel: bool = False,
    cp_method: str = "ring",
    ulysses: int = 1,
    split=None,
) -> list[dict[str, int]]:
    """Payload bytes per step of a rank of each pipeline rank, by "axis kind" (what parlab.core.comm records):

    tp   per micro-batch 4 all-reduces of [b, T/C, H] per block (an MoE block: 2, its experts replicated over tp),
         1 for the embedding, 1 + 3 x [b, T/C] for the
         LM head and loss; SP: per block 4 all-gathers of [b, T/(C tp), H] and 4 reduce-scatters of [b, T/C, H]
         (embedding and head 1 of each), the loss's 3, and the sum of SP's sequence-split gradients (per step;
         with ZeRO 2-3 per micro-batch); a zb-type schedule's BW repeats the all-gather under each block's two
         reduce-scatters (BI already passed through them to reach the stage input)
    cp   ring: per block and micro-batch 3C - 2 sends of a K/V block [2, b, nh/tp, T/C, hs] (C - 1 forward,
         C - 1 K/V and C dK/dV backward); Ulysses: 8 all-to-alls of [b, nh/tp, T/C, hs]; USP: those 8 on the
         ulysses sub-axis (U ranks), and 3R - 2 sends of [2, b, nh/(tp U), T/R, hs] on the ring sub-axis (R ranks)
    pp   one [b, T/C, H] (SP: [b, T/(C tp), H]) per F not on the last stage and per backward not on the first
    dp (dp_cp when C > 1, N = D C ranks)  an all-reduce of the parameters held; ZeRO: per unit a reduce-scatter of
         its flat gradients [N S_u] (stages 2-3: once per micro-batch) and all-gathers of the shard [S_u] (stage 3:
         before each forward and each backward); with ep, only the non-expert weights there, and the experts'
         (E/ep per MoE layer) all-reduced over edp (the N / ep ranks holding them); the ep all-to-alls depend on
         the routing: the report counts them from each call's split sizes (hybrid_experts.ep_all_to_all_bytes)
    b = B / (D m) rows per micro-batch.
    """
    D, S, C, Tt = (sizes[a] for a in ("dp", "pp", "cp", "tp"))
    ep = sizes.get("ep", 1)
    m, e, H, nh = schedule.m, cfg.dtype_bytes, cfg.hidden, cfg.heads
    b = batch // (D * m)
    BTH, BT = b * (cfg.seq_len // C) * H * e, b * (cfg.seq_len // C) * e
    message = BTH // Tt if sequence_parallel else BTH
    sends = theory_send_bytes(schedule, message)
    grad_axis, N = ("dp" if C == 1 else "dp_cp"), D * C
    rows = []
    for r in range(S):
        held = stage_layers(cfg, schedule, r, split)
        L = sum(len(layers) for _, layers in held)
        L_moe = sum(is_moe_block(cfg, i) for _, layers in held for i in layers)  # no tp collective in their FFN
        first, last = any(s == 0 for s, _ in held), any(s == schedule.num_stages - 1 for s, _ in held)
        row: dict[str, int] = {}
        if Tt > 1 and not sequence_parallel:
            row["tp all_reduce"] = m * ((4 * L - 2 * L_moe + first + last) * BTH + 3 * last * BT)
        elif Tt > 1:
            sp_numbers = L * 6 * H + first * cfg.seq_len * H + last * 2 * H  # LayerNorms, row biases, wpe, ln_f
            bw = sum(len(held[a.chunk][1]) for a in schedule.actions[r] if a.op == "BW")  # blocks a BW redoes
            row["tp all_gather"] = (m * (4 * L + first + last) + 2 * bw) * BTH // Tt
            row["tp reduce_scatter"] = m * (4 * L + first + last) * BTH
            row["tp all_reduce"] = m * 3 * last * BT + sp_numbers * e * (m if zero >= 2 else 1)
        if C > 1 and cp_method == "usp":
            U, R = usp_sizes(C, ulysses)
            usp = usp_bytes_per_call(b, nh // Tt, cfg.seq_len, H // nh, U, R, e)
            row["ulysses all_to_all"] = m * L * usp["ulysses"]
            row |= {"ring send": m * L * usp["ring"]} if R > 1 else {}
        elif C > 1 and cp_method == "ulysses":
            row["cp all_to_all"] = m * L * 8 * a2a_bytes_per_call(b, nh // Tt, cfg.seq_len, H // nh, C, e)
        elif C > 1:
            row["cp send"] = m * L * (3 * C - 2) * kv_block_bytes(b, nh // Tt, cfg.seq_len, H // nh, C, e)
        if S > 1:
            row["pp send"] = sends[r]
        units = unit_numels(cfg, schedule, r, Tt, split, ep)
        shard = sum(math.ceil(n / N) for n in units) * e  # S: this rank's piece of every unit
        experts = sum(block_numels(cfg, i, Tt, ep)[1] for _, layers in held for i in layers) if ep > 1 else 0
        if N > 1 and zero == 0:
            row[f"{grad_axis} all_reduce"] = (sum(units) - experts) * e
            if experts and N // ep > 1:
                row["edp all_reduce"] = experts * e
        elif N > 1:
            row[f"{grad_axis} reduce_scatter"] = N * shard * (m if zero >= 2 else 1)
            row[f"{grad_axis} all_gather"] = shard * (2 * m if zero == 3 else 1)
        rows.append(row)
    return rows
