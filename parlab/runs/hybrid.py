"""Run and check hybrid parallelism (parlab/hybrid.py): `python -m parlab run hybrid --dp 2 --tp 2 --pp 2`.

The ranks train the GPT with DP x PP x TP on a device mesh; the parent gathers each replica's TP slices and
stages back to full shape and compares them with one device, then checks each axis' measured traffic (from the
trace, filtered by the mesh axis of each call) and each rank's parameter bytes against the theory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parlab.check import check_equal, compare
from parlab.hybrid import check_parallel_dims, hybrid_comm_theory, hybrid_param_bytes, train_hybrid, unshard
from parlab.hybrid_axes import CP_METHODS
from parlab.launch import Results
from parlab.mesh import DeviceMesh, mesh_coords
from parlab.models import build_model, make_batches, train_single_device
from parlab.planner import Cluster, ModelSpec, Plan, estimate
from parlab.runs import Scheme, launch_scheme
from parlab.runs.options import ModelOptions, option
from parlab.runs.report import run_report
from parlab.runs.tensor_parallel import gather_full
from parlab.schedules import SCHEDULES, V_SCHEDULES, Schedule, make_schedule


@dataclass
class HybridOptions(ModelOptions):
    world_size: int = option(0, "number of ranks (0: dp x pp x cp x tp)", flag="--world")
    dp: int = option(2, "data-parallel replicas (the dp axis)")
    pp: int = option(1, "pipeline stages (the pp axis)")
    cp: int = option(1, "context-parallel ranks: each holds T/cp tokens of every sequence (the cp axis)")
    tp: int = option(2, "tensor-parallel ranks per stage (the tp axis)")
    layers: int = option(4, "transformer blocks, shared out among the pp stages")
    microbatches: int = option(2, "m, micro-batches per step in each pipeline")
    schedule: str = option("1f1b", "the pipeline schedule over pp", choices=list(SCHEDULES))
    virtual: int = option(0, "v, model chunks per pp rank (0: 2 for interleaved, zbv and dualpipev, else 1)")
    zero: int = option(0, "ZeRO stage over dp x cp: 0 (all-reduce the gradients), 1, 2 or 3 (needs --optimizer adam)")
    sequence_parallel: bool = option(False, "Megatron sequence parallelism on the tp axis (needs --tp > 1)")
    cp_method: str = option("ring", "attention over the cp axis: ring, zigzag or ulysses", choices=list(CP_METHODS))
    optimizer: str = option("auto", "sgd or adam (auto: adam with --zero, ZeRO's own; else sgd)",
                            choices=["auto", "sgd", "adam"])  # fmt: skip
    lr: float = option(0.0, "learning rate (0: 0.1 for sgd, 0.01 for adam)", bounds="[0, 100]")

    def __post_init__(self):
        if self.world_size == 0:
            self.world_size = self.dp * self.pp * self.cp * self.tp
        if self.optimizer == "auto":
            self.optimizer = "adam" if self.zero else "sgd"
        if self.lr == 0:
            self.lr = 0.01 if self.optimizer == "adam" else 0.1

    @property
    def axes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}

    @property
    def v(self) -> int:
        return self.virtual or (2 if self.schedule in ("interleaved", *V_SCHEDULES) else 1)

    def validate(self) -> None:
        super().validate()
        check_parallel_dims(self.gpt_config(), self.axes, world_size=self.world_size, batch=self.batch,
                            microbatches=self.microbatches, schedule=self.schedule, virtual=self.v, zero=self.zero,
                            sequence_parallel=self.sequence_parallel, cp_method=self.cp_method,
                            optimizer=self.optimizer)  # fmt: skip

    def forward_flops(self) -> float:
        """One paced F action (`--pace h100`): a micro-batch of b = B/(dp m) sequences through one stage's
        L/(pp v) blocks, this rank's 1/(tp cp) of the work (its heads and FFN columns, its T/cp queries)."""
        from parlab.hardware import gpt_forward_flops

        rows = self.batch // (self.dp * self.microbatches)
        blocks = self.layers // (self.pp * self.v)
        return gpt_forward_flops(self.gpt_config(), rows, layers=blocks, head=False) / (self.tp * self.cp)

    def make_schedule(self) -> Schedule:
        return make_schedule(self.schedule, self.pp, self.microbatches, self.v)


def hybrid_rank(opts: HybridOptions) -> dict:
    """Rank code: build the mesh (torch's DeviceMesh), train with every axis at once."""
    cfg = opts.gpt_config()
    return train_hybrid(
        build_model(cfg, opts.seed),
        DeviceMesh(opts.axes),
        opts.make_schedule(),
        make_batches(cfg, opts.batch, opts.steps, opts.seed),
        optimizer=opts.optimizer,
        lr=opts.lr,
        zero_stage=opts.zero,
        sequence_parallel=opts.sequence_parallel,
        cp_method=opts.cp_method,
    )


def _ranks(coords: list[dict], **where) -> list[int]:
    """The ranks at these coordinates, in rank order."""
    return [r for r, c in enumerate(coords) if all(c[a] == i for a, i in where.items())]


def gathered_model(opts: HybridOptions, results: Results, replica: int) -> tuple[dict, dict]:
    """(first-step gradients averaged over the batch, final parameters) of replica `replica`, by the reference
    model's names, at full shape: each stage's tp slices gathered; with ZeRO, the gradient shards of the dp x cp
    group put side by side (each is the sum over the group of its piece) and divided by its size."""
    coords, N = results_coords(opts), opts.dp * opts.cp
    grads, params = {}, {}
    for pp_rank in range(opts.pp):
        slices = _ranks(coords, dp=replica, pp=pp_rank, cp=0)  # its tp ranks
        dims = results[slices[0]]["split_dims"]
        params |= gather_full([results[r]["params"] for r in slices], dims)
        if opts.zero:
            per_tp = []
            for t in range(opts.tp):
                group = _ranks(coords, pp=pp_rank, tp=t)  # dp x cp, in group order
                summed = unshard([results[q]["grad_shard"] for q in group], results[group[0]]["units"])
                per_tp.append({n: g / N for n, g in summed.items()})
            grads |= gather_full(per_tp, dims)
        else:
            grads |= gather_full([results[r]["grads"] for r in slices], dims)
    return grads, params


def results_coords(opts: HybridOptions) -> list[dict]:
    return [mesh_coords(r, opts.axes) for r in range(opts.world_size)]


def hybrid_report(opts: HybridOptions, results: Results) -> dict:
    """Compare every replica with one device; check each axis' bytes by kind and each rank's parameter bytes."""
    cfg, P, K = opts.gpt_config(), opts.world_size, opts.steps
    reference = train_single_device(
        cfg, make_batches(cfg, opts.batch, K, opts.seed), opts.seed, opts.optimizer, opts.lr
    )
    coords = results_coords(opts)
    verdicts = []
    for replica in range(opts.dp):
        grads, params = gathered_model(opts, results, replica)
        verdicts.append(compare(f"replica {replica}: gradients of step 1, gathered", grads, reference.grads,
                                show=False))  # fmt: skip
        verdicts.append(compare(f"replica {replica}: parameters after {K} steps", params, reference.params,
                                show=False))  # fmt: skip
    schedule = opts.make_schedule()
    last = [r for r in _ranks(coords, tp=0) if results[r]["losses"] is not None]  # last stage: each dp, cp place
    loss = [sum(results[r]["losses"][k] for r in last) / len(last) for k in range(K)]  # means over equal shares
    dtype = cfg.torch_dtype
    verdicts.insert(0, compare(f"loss of each of {K} steps", torch.tensor(loss, dtype=dtype),
                               torch.tensor(reference.losses, dtype=dtype), show=False))  # fmt: skip

    theory = hybrid_comm_theory(cfg, schedule, opts.batch, opts.axes, zero=opts.zero,
                                sequence_parallel=opts.sequence_parallel, cp_method=opts.cp_method)  # fmt: skip
    events = [e for e in results.trace.events if not e.is_compute and not e.label.startswith("check")]
    # An axis as large as the world is torch's default group, which has no mesh name: its calls are that axis'.
    whole = [a for a, n in opts.axes.items() if n == P > 1]
    for e in events:
        if e.axis is None and whole and e.group in (None, tuple(range(P))):
            e.axis = whole[0]
    measured: dict[str, list[int]] = {}
    for e in events:
        if e.kind != "recv":  # a receive mirrors its send
            measured.setdefault(f"{e.axis} {e.kind}", [0] * P)[e.rank] += e.bytes
    expected = {key: [theory[c["pp"]].get(key, 0) * K for c in coords] for row in theory for key in row}
    counts = []
    for key in sorted(set(measured) | set(expected)):
        got, want = measured.get(key, [0] * P), expected.get(key, [0] * P)
        wrong = sum(a != b for a, b in zip(got, want, strict=True))
        counts.append(check_equal(f"{key.split()[0]} axis: ranks whose {key.split()[1]} bytes differ from theory",
                                  wrong, 0, show=False))  # fmt: skip
    allowed = {"dp", "pp", "cp", "tp", "dp_cp"}
    stray = [e for e in events if e.axis not in allowed]
    counts.append(check_equal("calls on no mesh axis (every call must be on dp, pp, cp, tp or dp_cp)", len(stray), 0,
                              show=False))  # fmt: skip
    pb_theory = [hybrid_param_bytes(cfg, schedule, c["pp"], opts.axes, opts.zero) for c in coords]
    pb = [r["param_bytes"] for r in results]
    wrong = sum(a != b for a, b in zip(pb, pb_theory, strict=True))
    counts.append(check_equal("ranks whose parameter bytes differ from theory", wrong, 0, show=False))
    return run_report(
        "hybrid",
        P,
        verdicts,
        passed=all(v.passed for v in verdicts + counts),
        comm={
            **results.trace.bytes_per_rank(),
            "per_axis_measured": {k: measured.get(k, [0] * P) for k in sorted(expected)},
            "per_axis_theory": {k: expected[k] for k in sorted(expected)},
        },
        lines=[v.line for v in verdicts + counts],
        mesh={"axes": opts.axes, "coords": coords},
        options={
            "zero": opts.zero,
            "sequence_parallel": opts.sequence_parallel,
            "cp_method": opts.cp_method,
            "schedule": opts.schedule,
            "virtual": opts.v,
        },  # fmt: skip
        bytes_per_rank={"params": pb, "params_theory": pb_theory},
        state_bytes=[r["state_bytes"] for r in results],
        peak_activation_bytes=[r["peak_activation_bytes"] for r in results],
        param_bytes_single_device=cfg.dtype_bytes * sum(p.numel() for p in build_model(cfg).parameters()),
        microbatches=opts.microbatches,
        layers=cfg.layers,
        steps=K,
    )


def run_hybrid(dp: int = 2, pp: int = 1, tp: int = 2, cp: int = 1, **options) -> tuple[Results, dict]:
    """Run hybrid parallelism on dp x pp x cp x tp live ranks; returns (results, report) as
    `python -m parlab run hybrid`."""
    return launch_scheme("hybrid", dp=dp, pp=pp, cp=cp, tp=tp, **options)


def model_spec(opts: ModelOptions) -> ModelSpec:
    """The planner's description of the reference GPT these options build."""
    cfg = opts.gpt_config()
    return ModelSpec(cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len, cfg.vocab_size, cfg.ffn, cfg.tied)


def check_plan(plan: Plan, **options) -> dict:
    """Run a plan at small size (the reference GPT with `options`, on dp x pp x cp x tp live ranks, with its
    ZeRO stage and SP) and put the planner's estimates for the busiest device beside what the ranks measured:
    the model states (params, grads, optimizer states, counted from the tensors each rank holds) and the
    activations (the peak bytes autograd kept for backward, parlab.memory), estimated at this run's dtype."""
    if plan.offload or plan.ep > 1 or plan.recompute != "none":
        raise ValueError(f"{plan}: the hybrid run has no offload, expert or recompute axis (run them alone)")
    run = {"dp": plan.dp, "pp": plan.pp, "cp": plan.cp, "tp": plan.tp, "zero": plan.zero}
    run |= {"sequence_parallel": plan.sp, "cp_method": "ulysses" if plan.cp_method == "ulysses" else "ring"}
    results, report = run_hybrid(**run, **options)
    opts = HybridOptions.make(**run, **options)
    e = opts.gpt_config().dtype_bytes
    adam = 3 * e if plan.zero else (2 * e if opts.optimizer == "adam" else 0)  # ZeRO keeps a master copy too
    rows = opts.batch // (plan.dp * opts.microbatches)
    cluster = Cluster(devices=opts.world_size, memory=float("inf"))
    device = estimate(model_spec(opts), cluster, plan, opts.batch, rows, (e, e, adam), e, True).device_bytes
    estimated = {
        "states": device["params"] + device["grads"] + device["optimizer"],
        "activations": device["activations"],
    }
    measured = {
        "states": max(sum(r["state_bytes"].values()) for r in results),
        "activations": max(r["peak_activation_bytes"] for r in results),
    }
    return {
        "plan": str(plan),
        "estimated": estimated,
        "measured": measured,
        "ratio": {k: measured[k] / estimated[k] for k in estimated},
        "estimated_state_bytes": estimated["states"],
        "measured_state_bytes": measured["states"],
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
