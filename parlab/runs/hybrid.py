"""Run and check hybrid parallelism (parlab/hybrid.py): `python -m parlab run hybrid --dp 2 --tp 2 --pp 2`.

The ranks train the GPT with DP x PP x TP on a device mesh; the parent gathers each replica's TP slices and
stages back to full shape and compares them with one device, then checks each axis' measured traffic (from the
trace, filtered by the mesh axis of each call) and each rank's parameter bytes against the theory.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from parlab.check import check_equal, compare
from parlab.hybrid import AXES, hybrid_comm_theory, hybrid_param_bytes, train_hybrid
from parlab.launch import Results
from parlab.mesh import DeviceMesh, check_mesh, mesh_coords
from parlab.models import build_model, make_batches, train_single_device
from parlab.pipeline import split_layers
from parlab.planner import Cluster, ModelSpec, Plan, estimate
from parlab.runs import Scheme, launch_scheme
from parlab.runs.options import ModelOptions, option, positive
from parlab.runs.tensor_parallel import TPOptions, gather_full
from parlab.schedules import check_schedule_args, make_schedule
from parlab.sequence_parallel import grad_sync_theory, megatron_sp_layer_theory


@dataclass
class HybridOptions(ModelOptions):
    world_size: int = option(0, "number of ranks (0: dp x pp x tp)", flag="--world")
    dp: int = option(2, "data-parallel replicas (the dp axis)")
    pp: int = option(1, "pipeline stages (the pp axis)")
    tp: int = option(2, "tensor-parallel ranks per stage (the tp axis)")
    layers: int = option(4, "transformer blocks, shared out among the pp stages")
    microbatches: int = option(2, "m, micro-batches per step in each pipeline (1F1B)")
    zero: int = option(0, "ZeRO stage over the dp axis: 0 (all-reduce the gradients) or 1 (needs --optimizer adam)")
    sequence_parallel: bool = option(False, "Megatron sequence parallelism on the tp axis (needs --pp 1, --tp > 1)")

    def __post_init__(self):
        if self.world_size == 0:
            self.world_size = self.dp * self.pp * self.tp

    @property
    def axes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    def validate(self) -> None:
        super().validate()
        for axis, size in self.axes.items():
            positive(axis, size)
        check_mesh(self.axes, self.world_size)  # dp x pp x tp must be the world size
        check_schedule_args("1f1b", self.pp, self.microbatches)
        rows = self.batch // self.dp
        if self.batch % self.dp or rows % self.microbatches:
            raise ValueError(
                f"batch={self.batch} must split into dp={self.dp} replicas of microbatches={self.microbatches} "
                "equal micro-batches"
            )
        if self.layers % self.pp:
            raise ValueError(f"layers={self.layers} is not divisible by pp={self.pp} (blocks per pipeline stage)")
        split_layers(self.layers, self.pp)
        if self.zero not in (0, 1):
            raise ValueError(
                f"zero={self.zero}: the hybrid offers ZeRO stage 1 over dp (a pipeline accumulates "
                "gradients over micro-batches, which stages 2 and 3 reduce as they arrive); "
                "run stages 2 and 3 alone with `parlab run zero`"
            )
        if self.zero and self.optimizer != "adam":
            raise ValueError("zero=1 steps with ZeRO's own Adam: add --optimizer adam (and a smaller --lr)")
        if self.sequence_parallel and (self.pp != 1 or self.tp < 2):
            raise ValueError(
                f"sequence_parallel needs pp=1 and tp>=2 (got pp={self.pp}, tp={self.tp}): Megatron "
                "SP splits the tp group's activations along the sequence"
            )
        if self.sequence_parallel and self.zero:
            raise ValueError("sequence_parallel with zero: not combined here; pick one")
        if self.tied and self.pp > 1:
            raise ValueError("a tied embedding and LM head live on different pipeline stages: use --pp 1 or untied")
        try:  # what TP splits, named by its axis: the tp axis is not the whole world here
            TPOptions.for_config(self.gpt_config(), world_size=self.tp, batch=1).validate()
        except ValueError as exc:
            raise ValueError(f"the tp axis (tp={self.tp}): {str(exc).replace('world_size=', 'tp=')}") from None


def hybrid_rank(opts: HybridOptions) -> dict:
    """Rank code: build the mesh (torch's DeviceMesh), train with DP x PP x TP."""
    mesh = DeviceMesh(opts.axes)
    cfg = opts.gpt_config()
    schedule = make_schedule("1f1b", opts.pp, opts.microbatches)
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed)
    return train_hybrid(
        build_model(cfg, opts.seed),
        mesh,
        schedule,
        batches,
        optimizer=opts.optimizer,
        lr=opts.lr,
        zero_stage=opts.zero,
        sequence_parallel=opts.sequence_parallel,
    )


def hybrid_report(opts: HybridOptions, results: Results) -> dict:
    """Compare every replica with one device; check each axis' bytes and each rank's parameter bytes."""
    cfg, axes, P, K = opts.gpt_config(), opts.axes, opts.world_size, opts.steps
    reference = train_single_device(
        cfg, make_batches(cfg, opts.batch, K, opts.seed), opts.seed, opts.optimizer, opts.lr
    )
    coords = [mesh_coords(r, axes) for r in range(P)]
    verdicts = []
    for replica in range(opts.dp):
        params, grads = {}, {}
        for stage in range(opts.pp):
            ranks = [r for r in range(P) if coords[r]["dp"] == replica and coords[r]["pp"] == stage]  # its tp group
            dims = results[ranks[0]]["split_dims"]
            params |= gather_full([results[r]["params"] for r in ranks], dims)
            # Step 1's gradients averaged over the replicas: the same as each rank's after a DP all-reduce, and
            # what ZeRO's reduce-scatter averages (its ranks keep their own, un-reduced, full gradients).
            twins = [[q for q in range(P) if {**coords[q], "dp": 0} == {**coords[r], "dp": 0}] for r in ranks]
            averaged = [{n: sum(results[q]["grads"][n] for q in qs) / opts.dp for n in dims} for qs in twins]
            grads |= gather_full(averaged, dims)
        verdicts.append(compare(f"replica {replica}: gradients of step 1, gathered", grads, reference.grads,
                                show=False))  # fmt: skip
        verdicts.append(compare(f"replica {replica}: parameters after {K} steps", params, reference.params,
                                show=False))  # fmt: skip
    last = [r for r in range(P) if coords[r]["pp"] == opts.pp - 1 and coords[r]["tp"] == 0]  # one per replica
    loss = [sum(results[r]["losses"][k] for r in last) / opts.dp for k in range(K)]
    dtype = cfg.torch_dtype
    loss_verdict = compare(f"loss of each of {K} steps", torch.tensor(loss, dtype=dtype),
                           torch.tensor(reference.losses, dtype=dtype), show=False)  # fmt: skip
    verdicts.insert(0, loss_verdict)

    schedule = make_schedule("1f1b", opts.pp, opts.microbatches)
    theory = hybrid_comm_theory(cfg, schedule, opts.batch, opts.dp, opts.tp, zero_stage=opts.zero)
    if opts.sequence_parallel:  # Megatron SP replaces the tp axis' all-reduces: its own checks, below
        theory = [{**row, "tp": {}} for row in theory]
    measured, expected, counts = {}, {}, []
    for axis in AXES:
        kinds = sorted({kind for row in theory for kind in row[axis]})
        by_kind = results.trace.bytes_per_rank(axis=axis)
        for kind in kinds:
            measured[f"{axis} {kind}"] = by_kind.get(kind, [0] * P)
            expected[f"{axis} {kind}"] = [theory[c["pp"]][axis].get(kind, 0) * K for c in coords]
            wrong = sum(a != b for a, b in zip(measured[f"{axis} {kind}"], expected[f"{axis} {kind}"], strict=True))
            counts.append(check_equal(f"{axis} axis: ranks whose {kind} bytes differ from theory", wrong, 0,
                                      show=False))  # fmt: skip
    if opts.sequence_parallel:
        counts += _sequence_parallel_checks(opts, results)
    stray = [e for e in results.trace.events if not e.is_compute and e.axis not in AXES]
    counts.append(check_equal("calls on no mesh axis (every call must be on dp, pp or tp)", len(stray), 0, show=False))
    ranges = split_layers(cfg.layers, opts.pp)
    pb_theory = [hybrid_param_bytes(cfg, c["pp"], ranges[c["pp"]], opts.pp, opts.tp) for c in coords]
    if opts.zero:  # the flat buffers ZeRO keeps the parameters in are padded to dp x S
        e = cfg.dtype_bytes
        pb_theory = [opts.dp * math.ceil(b // e / opts.dp) * e for b in pb_theory]
    pb = [r["param_bytes"] for r in results]
    wrong = sum(a != b for a, b in zip(pb, pb_theory, strict=True))
    counts.append(check_equal("ranks whose parameter bytes differ from theory", wrong, 0, show=False))
    worst = max(verdicts, key=lambda v: v.max_abs_err)
    return {
        "scheme": "hybrid",
        "world_size": P,
        "passed": all(v.passed for v in verdicts + counts),
        "max_abs_err": worst.max_abs_err,
        "tol": worst.tol,
        "comm": {
            **results.trace.bytes_per_rank(),
            "per_axis_measured": measured,
            "per_axis_theory": expected,
        },
        "verdicts": [v.line for v in verdicts + counts],
        "mesh": {"axes": axes, "coords": coords},
        "bytes_per_rank": {"params": pb, "params_theory": pb_theory},
        "param_bytes_single_device": cfg.dtype_bytes * sum(p.numel() for p in build_model(cfg).parameters()),
        "microbatches": opts.microbatches,
        "layers": cfg.layers,
        "steps": K,
    }


def _sequence_parallel_checks(opts: HybridOptions, results: Results) -> list:
    """Megatron SP on the tp axis: the blocks' all-gathers and reduce-scatters, and the LayerNorm gradients'
    all-reduce, per rank per step, against parlab.sequence_parallel's theory (b = B / D rows per replica)."""
    cfg, tp, K = opts.gpt_config(), opts.tp, opts.steps
    theory = megatron_sp_layer_theory(cfg, opts.batch // opts.dp, tp)
    in_blocks = [e for e in results.trace.select(axis="tp") if re.search(r"(attn|mlp) \d+$", e.label)]
    checks = []
    for kind in ("all_gather", "reduce_scatter"):
        per_rank = [sum(e.bytes for e in in_blocks if e.kind == kind and e.rank == r) for r in range(opts.world_size)]
        wrong = sum(b != theory[kind] * K for b in per_rank)
        checks.append(check_equal(f"tp axis (SP): ranks whose blocks' {kind} bytes differ from theory", wrong, 0,
                                  show=False))  # fmt: skip
    sp_grads = [sum(e.bytes for e in results.trace.select(rank=r, axis="tp") if e.label == "sp grads")
                for r in range(opts.world_size)]  # fmt: skip
    wrong = sum(b != grad_sync_theory(cfg, "megatron-sp", tp) * K for b in sp_grads)
    checks.append(check_equal("tp axis (SP): ranks whose LayerNorm-gradient all-reduce bytes differ", wrong, 0,
                              show=False))  # fmt: skip
    return checks


def run_hybrid(dp: int = 2, pp: int = 1, tp: int = 2, **options) -> tuple[Results, dict]:
    """Run hybrid parallelism on dp x pp x tp live ranks; returns (results, report) as `python -m parlab run hybrid`."""
    return launch_scheme("hybrid", dp=dp, pp=pp, tp=tp, **options)


def model_spec(opts: ModelOptions) -> ModelSpec:
    """The planner's description of the reference GPT these options build."""
    cfg = opts.gpt_config()
    return ModelSpec(cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len, cfg.vocab_size, cfg.ffn, cfg.tied)


def check_plan(plan: Plan, **options) -> dict:
    """Run a plan at small size (the reference GPT with `options`, on dp x tp x pp live ranks) and put the
    planner's estimate of the model states a device holds (params, grads, optimizer states; the busiest device)
    beside the figure measured from the tensors each rank holds. Activations are left out: the planner's formula
    is for 2-byte activations of a large model, not for this tiny float64 one."""
    if plan.sp or plan.zero or plan.offload:
        raise ValueError(f"{plan}: the hybrid run combines DP, TP and PP only; SP, ZeRO and offload run alone")
    results, report = run_hybrid(plan.dp, plan.pp, plan.tp, **options)
    opts = HybridOptions.make(dp=plan.dp, pp=plan.pp, tp=plan.tp, **options)
    e = opts.gpt_config().dtype_bytes
    bytes_per = (e, e, 2 * e if opts.optimizer == "adam" else 0)  # Adam keeps m and v in the model's dtype
    rows = opts.batch // (plan.dp * opts.microbatches)
    cluster = Cluster(devices=opts.world_size, memory=float("inf"))
    estimated = estimate(model_spec(opts), cluster, plan, opts.batch, rows, bytes_per).device_bytes
    estimated_states = estimated["params"] + estimated["grads"] + estimated["optimizer"]
    measured = max(sum(r["state_bytes"].values()) for r in results)
    return {
        "plan": str(plan),
        "estimated_state_bytes": estimated_states,
        "measured_state_bytes": measured,
        "ratio": measured / estimated_states,
        "report": report,
    }


SCHEMES = [
    Scheme(
        "hybrid",
        "hybrid parallelism on a device mesh: data x pipeline (1F1B) x tensor parallel, each on its own axis",
        HybridOptions,
        hybrid_rank,
        hybrid_report,
    )
]
