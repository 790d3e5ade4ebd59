"""Run and check hybrid parallelism (parlab/schemes/hybrid/train.py): `python -m parlab run hybrid --dp 2 --tp 2 --pp
2`.

The ranks train the GPT with DP x PP x CP x TP on a device mesh (with --experts E an MoE GPT, its experts over
--ep ranks borrowed from dp x cp; with --cp-method usp the cp axis split into ulysses x ring); the parent gathers
each replica's TP slices, stages and experts back to full shape and compares them with one device (routed in the
same capacity groups), then checks each axis' measured traffic (from the trace, filtered by the mesh axis of each
call; the ep all-to-alls against each call's split sizes) and each rank's parameter bytes against the theory.
"""

from __future__ import annotations

from dataclasses import dataclass

from parlab.core.check import check_equal, compare, host_values
from parlab.core.comm import device
from parlab.core.mesh import DeviceMesh, mesh_coords
from parlab.core.models import GPTConfig, build_model, make_batches
from parlab.core.moe import MoEConfig
from parlab.runs.expert_parallel import reference_routing
from parlab.runs.options import ModelOptions, option, positive
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import compare_losses, count_checks, model_fields, run_report, single_device_run
from parlab.runs.zero import param_count
from parlab.runtime.errors import Results
from parlab.schemes.expert_parallel import is_expert_param
from parlab.schemes.hybrid.experts import default_ulysses, ep_all_to_all_bytes, reference_seq_groups
from parlab.schemes.hybrid.planner import Cluster, ModelSpec, Plan, estimate
from parlab.schemes.hybrid.stage import CP_METHODS
from parlab.schemes.hybrid.train import (
    check_parallel_dims,
    hybrid_comm_theory,
    hybrid_param_bytes,
    train_hybrid,
    unshard,
)
from parlab.schemes.pipeline.actions import Schedule
from parlab.schemes.pipeline.schedules import SCHEDULES, V_SCHEDULES, make_schedule
from parlab.schemes.tensor_parallel import gather_full


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
    cp_method: str = option(
        "ring", "attention over the cp axis: ring, zigzag, ulysses or usp", choices=list(CP_METHODS)
    )
    ulysses: int = option(0, "USP: the ulysses sub-axis of cp (ring = cp / ulysses; 0: gcd(cp, heads / tp))")
    ep: int = option(1, "expert-parallel ranks, borrowed from dp x cp: each holds E / ep experts of each MoE layer")
    experts: int = option(0, "E, experts per MoE layer (0: a dense GPT)")
    top_k: int = option(2, "k, experts each token is sent to")
    capacity_factor: float = option(
        1.25, "slots per expert and capacity group = ceil(factor x tokens x k / E)", bounds="(0, 1000]"
    )
    drop: bool = option(True, "drop the tokens past an expert's capacity (--no-drop: every expert takes all)")
    aux_weight: float = option(0.01, "weight of the load-balancing loss in the training loss", bounds="[0, 100]")
    moe_every: int = option(1, "an MoE FFN in every block (1) or every other block (2)")
    optimizer: str = option(
        "auto", "sgd or adam (auto: adam with --zero, ZeRO's own; else sgd)", choices=["auto", "sgd", "adam"]
    )
    lr: float = option(0.0, "learning rate (0: 0.1 for sgd, 0.01 for adam)", bounds="[0, 100]")

    def __post_init__(self):
        if self.world_size == 0:
            self.world_size = self.dp * self.pp * self.cp * self.tp
        if self.optimizer == "auto":
            self.optimizer = "adam" if self.zero else "sgd"
        if self.lr == 0:
            self.lr = 0.01 if self.optimizer == "adam" else 0.1
        if self.ulysses == 0:
            self.ulysses = default_ulysses(self.cp, self.heads // max(self.tp, 1)) if self.cp_method == "usp" else 1

    @property
    def axes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh's axes and ep (which splits dp x cp, no axis of its own)."""
        return {**self.axes, "ep": self.ep}

    def gpt_config(self) -> GPTConfig:
        """The reference GPT; with experts, its MoE routes in the ranks' capacity groups: one per replica and
        micro-batch (rows), and one per cp block (positions)."""
        cfg = super().gpt_config()
        if not self.experts:
            return cfg
        layout, chunks = ("zigzag", 2 * self.cp) if self.cp_method == "zigzag" else ("contiguous", self.cp)
        seq_groups = reference_seq_groups(self.seq, self.cp, layout) if self.cp > 0 and self.seq % chunks == 0 else ()
        moe = MoEConfig(
            self.experts,
            self.top_k,
            self.capacity_factor,
            self.drop,
            self.aux_weight,
            self.moe_every,
            groups=max(self.dp * self.microbatches, 1),
            seq_groups=seq_groups,
        )
        return GPTConfig(**{**cfg.__dict__, "moe": moe})

    @property
    def v(self) -> int:
        return self.virtual or (2 if self.schedule in ("interleaved", *V_SCHEDULES) else 1)

    def validate(self) -> None:
        # The axes first: the world size is their product (a tp of 0 would otherwise read "world_size=0").
        for axis, n in self.sizes.items():
            positive(axis, n)
        super().validate()
        if not self.experts:
            self.no_effect(
                ("top_k", "capacity_factor", "drop", "aux_weight", "moe_every"),
                "without experts (a dense GPT routes no token: add --experts E)",
            )
        elif not self.drop:
            self.no_effect(("capacity_factor",), "with drop off (--no-drop: every expert takes every token)")
        check_parallel_dims(
            self.gpt_config(),
            self.sizes,
            world_size=self.world_size,
            batch=self.batch,
            microbatches=self.microbatches,
            schedule=self.schedule,
            virtual=self.v,
            zero=self.zero,
            sequence_parallel=self.sequence_parallel,
            cp_method=self.cp_method,
            optimizer=self.optimizer,
            ulysses=self.ulysses,
        )

    def forward_flops(self) -> float:
        """One paced F action (`--pace h100`): a micro-batch of b = B/(dp m) sequences through one stage's
        L/(pp v) blocks, this rank's 1/(tp cp) of the work (its heads and FFN columns, its T/cp queries)."""
        from parlab.core.hardware import gpt_forward_flops

        rows = self.batch // (self.dp * self.microbatches)
        blocks = self.layers // (self.pp * self.v)
        return gpt_forward_flops(self.gpt_config(), rows, layers=blocks, head=False) / (self.tp * self.cp)

    def make_schedule(self) -> Schedule:
        return make_schedule(self.schedule, self.pp, self.microbatches, self.v)


def hybrid_rank(opts: HybridOptions) -> dict:
    """Rank code: build the mesh (torch's DeviceMesh), train with every axis at once."""
    cfg, dev = opts.gpt_config(), device()  # dev: this rank's GPU under NCCL, else the CPU
    return train_hybrid(
        build_model(cfg, opts.seed, device=dev),
        DeviceMesh(opts.axes),
        opts.make_schedule(),
        make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev),
        optimizer=opts.optimizer,
        lr=opts.lr,
        zero_stage=opts.zero,
        sequence_parallel=opts.sequence_parallel,
        cp_method=opts.cp_method,
        ulysses=opts.ulysses,
        ep=opts.ep,
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
        if opts.ep > 1:  # the experts, each held by one rank of this replica's ep group (replicated over tp)
            n = replica * opts.cp // opts.ep  # the ep group of dp_cp index replica x C
            group = [
                r
                for r, c in enumerate(coords)
                if c["pp"] == pp_rank and c["tp"] == 0 and (c["dp"] * opts.cp + c["cp"]) // opts.ep == n
            ]
            params |= {k: w for r in group for k, w in results[r]["params"].items() if is_expert_param(k)}
            grads |= {k: g for r in group for k, g in results[r]["grads"].items() if is_expert_param(k)}
    return grads, params


def results_coords(opts: HybridOptions) -> list[dict]:
    return [mesh_coords(r, opts.axes) for r in range(opts.world_size)]


def hybrid_report(opts: HybridOptions, results: Results) -> dict:
    """Compare every replica with one device; check each axis' bytes by kind and each rank's parameter bytes."""
    cfg, P = opts.gpt_config(), opts.world_size
    coords = results_coords(opts)
    moe = moe_checks(opts, results, coords) if cfg.moe else {}
    verdicts = _numerics(opts, results, coords, moe)
    counts, measured, expected = _traffic(opts, results, coords)
    counts += moe.get("counts", [])
    schedule = opts.make_schedule()
    pb_theory = [hybrid_param_bytes(cfg, schedule, c["pp"], opts.sizes, opts.zero) for c in coords]
    pb = [r["param_bytes"] for r in results]
    wrong = sum(a != b for a, b in zip(pb, pb_theory, strict=True))
    counts.append(check_equal("ranks whose parameter bytes differ from theory", wrong, 0))
    return run_report(
        "hybrid",
        P,
        verdicts + counts,
        comm={
            **results.trace.bytes_per_rank(),
            "per_axis_measured": {k: measured.get(k, [0] * P) for k in sorted(expected)},
            "per_axis_theory": {k: expected[k] for k in sorted(expected)},
        },
        mesh={"axes": opts.axes, "coords": coords, "ep": opts.ep, "ulysses": opts.ulysses},
        options={
            "zero": opts.zero,
            "sequence_parallel": opts.sequence_parallel,
            "cp_method": opts.cp_method,
            "schedule": opts.schedule,
            "virtual": opts.v,
            "experts": opts.experts,
        },
        moe=moe.get("report", {}),
        bytes_per_rank={"params": pb, "params_theory": pb_theory},
        state_bytes=[r["state_bytes"] for r in results],
        peak_activation_bytes=[r["peak_activation_bytes"] for r in results],
        param_bytes_single_device=cfg.dtype_bytes * param_count(cfg),
        microbatches=opts.microbatches,
        **model_fields(cfg, opts, "layers", "steps"),
    )


def _numerics(opts: HybridOptions, results: Results, coords: list[dict], moe: dict) -> list:
    """The loss of each step, then every replica gathered to full shape, against one device; with experts, the
    aux loss is part of the loss (one device's includes it) and the routing verdicts follow."""
    cfg, K = opts.gpt_config(), opts.steps
    reference = single_device_run(opts)
    verdicts = []
    for replica in range(opts.dp):
        grads, params = gathered_model(opts, results, replica)
        verdicts.append(compare(f"replica {replica}: gradients of step 1, gathered", grads, reference.grads))
        verdicts.append(compare(f"replica {replica}: parameters after {K} steps", params, reference.params))
    last = [r for r in _ranks(coords, tp=0) if results[r]["losses"] is not None]  # last stage: each dp, cp place
    loss = [sum(results[r]["losses"][k] for r in last) / len(last) for k in range(K)]  # means over equal shares
    loss = [lm + cfg.moe.aux_weight * a for lm, a in zip(loss, moe["aux"], strict=True)] if moe else loss
    what = f"loss of each of {K} steps" + (" (aux included)" if moe else "")
    return [compare_losses(what, loss, reference.losses, cfg.torch_dtype), *verdicts, *moe.get("verdicts", [])]


def _traffic(opts: HybridOptions, results: Results, coords: list[dict]) -> tuple[list, dict, dict]:
    """Each axis' bytes by kind, per rank, against the theory (every call is filed under the mesh axis of its
    group), and no call off the mesh. Returns (checks, measured and expected bytes by "axis kind")."""
    cfg, P, K = opts.gpt_config(), opts.world_size, opts.steps
    theory = hybrid_comm_theory(
        cfg,
        opts.make_schedule(),
        opts.batch,
        opts.sizes,
        zero=opts.zero,
        sequence_parallel=opts.sequence_parallel,
        cp_method=opts.cp_method,
        ulysses=opts.ulysses,
    )
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
    if opts.ep > 1:  # the ep all-to-alls: what each call's split sizes call for, over all steps
        expected["ep all_to_all"] = [
            ep_all_to_all_bytes([rows for step in r["moe"] for rows in step["a2a_rows"]], cfg) for r in results
        ]
    rows = []
    for key in sorted(set(measured) | set(expected)):
        got, want = measured.get(key, [0] * P), expected.get(key, [0] * P)
        axis, kind = key.split()[:2]
        rows.append(
            (
                f"{axis} axis: ranks whose {kind} bytes differ from theory",
                sum(a != b for a, b in zip(got, want, strict=True)),
                0,
            )
        )
    allowed = {"dp", "pp", "cp", "tp", "dp_cp", "ep", "edp", "ulysses", "ring"}
    stray = [e for e in events if e.axis not in allowed]
    rows.append(("calls on no mesh axis (every call must be on dp, pp, cp, tp, dp_cp or a sub-axis)", len(stray), 0))
    return count_checks(rows), measured, expected


def moe_checks(opts: HybridOptions, results: Results, coords: list[dict]) -> dict:
    """The MoE's routing against one device routing the same capacity groups: the aux loss (per step, summed over
    layers, mean over the D m C groups), the dropped assignments and the load per expert of step 1."""
    cfg, K, E, dtype = opts.gpt_config(), opts.steps, opts.experts, opts.gpt_config().torch_dtype
    ranks = _ranks(coords, tp=0)  # each (dp, pp, cp) once: the tp ranks route the same tokens
    groups = opts.dp * opts.microbatches * opts.cp
    aux = [sum(results[r]["moe"][k]["aux"] for r in ranks) / groups for k in range(K)]
    x = make_batches(cfg, opts.batch, 1, opts.seed)[0][0]  # host: the parent's reference
    ref = reference_routing(cfg, x, opts.seed)
    load = [sum((results[r]["moe"][0]["load"] or [0] * E)[e] for r in ranks) for e in range(E)]  # [] if no MoE
    dropped = sum(results[r]["moe"][0]["dropped"] for r in ranks)
    a2a = [sum(n for step in r["moe"] for rows in step["a2a_rows"] for n in rows) for r in results]
    return {
        "aux": aux,
        "verdicts": [
            compare(
                "aux loss of step 1 (sum over MoE layers)",
                host_values([aux[0]], dtype),
                host_values([ref["aux"]], dtype),
            )
        ],
        "counts": [
            check_equal(
                "step 1: experts whose assignments differ from one device's",
                sum(a != b for a, b in zip(load, ref["load"], strict=True)),
                0,
            ),
            check_equal("step 1: dropped assignments, all ranks (one device's)", dropped, ref["dropped"]),
        ],
        "report": {
            "experts": E,
            "ep": opts.ep,
            "aux_loss": aux,
            "load_step1": load,
            "dropped_step1": dropped,
            "reference": ref,
            "a2a_rows_per_rank": a2a,
        },
    }


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
    activations (the peak bytes autograd kept for backward, parlab.core.memory), estimated at this run's dtype."""
    if plan.offload or plan.ep > 1 or plan.recompute != "none":
        raise ValueError(
            f"{plan}: check_plan measures dense plans (the planner's estimate of offload, experts and recompute is "
            "checked by their own runs: run offload, moe, and pp/tp with --recompute)"
        )
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
        "hybrid parallelism on one device mesh: data (ZeRO) x pipeline x context x tensor, + experts, each on its axis",
        HybridOptions,
        hybrid_rank,
        hybrid_report,
        quick=(("steps", 1), ("layers", 1)),
    )
]
