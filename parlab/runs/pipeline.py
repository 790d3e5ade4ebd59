"""Run and check pipeline parallelism (parlab/schemes/pipeline/): `python -m parlab run pp`.

The ranks build their stages of the reference GPT and train with the chosen schedule; the parent compares losses,
gradients and parameters with one device, counts the bytes sent against the schedule's messages, and reports the
bubble three ways: ideal (the exact simulation), formula (the textbook fraction) and measured (from the spans).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parlab.core.comm import device
from parlab.core.models import build_model, make_batches, make_optimizer
from parlab.runs.options import ModelOptions, int_list, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import count_checks, one_device_checks, run_report, single_device_run
from parlab.runtime.errors import Results
from parlab.schemes.pipeline.actions import Schedule
from parlab.schemes.pipeline.executor import (
    build_stages,
    measured_bubble,
    split_layers,
    theory_send_bytes,
    train_pipeline,
)
from parlab.schemes.pipeline.schedules import (
    SCHEDULES,
    V_SCHEDULES,
    bubble,
    bubble_formula,
    check_schedule_args,
    make_schedule,
    peak_inflight,
    phases,
    simulate,
    validate,
)
from parlab.schemes.pipeline.schedules_v import formula_holds


@dataclass
class PPOptions(ModelOptions):
    batch: int = option(16, "global batch size (sequences), cut into micro-batches")
    layers: int = option(8, "transformer blocks in the model, shared out among the p x v stages")
    schedule: str = option("1f1b", "the pipeline schedule", choices=SCHEDULES)
    microbatches: int = option(8, "m, micro-batches per step")
    virtual: int = option(0, "v, model chunks per rank (0: 2 for interleaved, zbv and dualpipev, else 1)")
    split: list = option([], "blocks per stage, e.g. 3,2,2,1 (default: even)", parse=int_list)
    megatron_warmup: bool = option(False, "interleaved: Megatron-LM's warm-up count")
    costs: dict = option({}, "unit costs of F, B, BI, BW for the ideal timeline (Python only), e.g. {'BW': 2}")

    @property
    def v(self) -> int:
        return self.virtual or (2 if self.schedule in ("interleaved", *V_SCHEDULES) else 1)

    def forward_flops(self) -> float:
        """One F: a stage of layers / (p v) blocks over one micro-batch (batch / m sequences); parlab.core.hardware."""
        from parlab.core.hardware import gpt_forward_flops

        stages = self.world_size * self.v
        return gpt_forward_flops(self.gpt_config(), self.batch // self.microbatches, self.layers / stages, False)

    def make_schedule(self) -> Schedule:
        p, m, v = self.world_size, self.microbatches, self.v
        return make_schedule(self.schedule, p, m, v, self.costs or None, self.megatron_warmup)

    def validate(self) -> None:
        super().validate()
        p, m, v = self.world_size, self.microbatches, self.v
        check_schedule_args(self.schedule, p, m, v)
        if self.megatron_warmup and self.schedule != "interleaved":
            raise ValueError(
                f"megatron_warmup: no effect with schedule {self.schedule!r} (it sets interleaved 1F1B's warm-up)"
            )
        if self.batch % m:
            raise ValueError(f"batch={self.batch} is not divisible by microbatches={m}")
        stages = p * v
        if self.layers < stages:
            raise ValueError(
                f"layers={self.layers} < stages x virtual = {p} x {v} = {stages}: every stage needs at least one "
                "block (use more --layers, fewer ranks, or a smaller --virtual)"
            )
        if not self.split and self.layers % stages:
            base, extra = divmod(self.layers, stages)
            example = ",".join(str(base + (s < extra)) for s in range(stages))
            raise ValueError(
                f"layers={self.layers} is not divisible by stages x virtual = {p} x {v} = {stages} "
                f"(give an explicit split of the blocks, e.g. --split {example})"
            )
        if self.split and min(self.split) < 1:
            raise ValueError(f"split {self.split}: every stage needs at least one block")
        split_layers(self.layers, stages, self.split or None)
        validate(self.make_schedule())  # complete, deadlock-free, messages in order: before any rank runs it


def pp_rank(opts: PPOptions) -> dict:
    """Rank code: build this rank's stages, train opts.steps steps with the schedule.

    Every rank builds the whole reference model from the seed (it is tiny) and keeps only its own stages."""
    cfg, schedule, dev = opts.gpt_config(), opts.make_schedule(), device()
    model = build_model(cfg, opts.seed, device=dev)  # this rank's GPU under NCCL, else the CPU
    stages = build_stages(model, schedule, torch.distributed.get_rank(), opts.split or None)
    del model  # what this rank does not hold goes away
    weights = [w for stage in stages.values() for w in stage.named.values()]
    optimizer = make_optimizer(weights, opts.optimizer, opts.lr)
    grad_group = torch.distributed.new_group(list(range(schedule.p)))  # gradients get a channel of their own
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)
    return train_pipeline(schedule, stages, optimizer, batches, grad_group=grad_group)


def phase_lines(schedule: Schedule) -> list[str]:
    """phases() as one printable line per rank: "rank 0: warm-up 3 F | steady 5 F + 5 B | cool-down 3 B"."""

    def text(counts: dict[str, int]) -> str:
        return " + ".join(f"{n} {op}" for op, n in counts.items()) or "none"

    return [
        f"rank {r}: warm-up {text(ph['warmup'])} | steady {text(ph['steady'])} | cool-down {text(ph['cooldown'])}"
        for r, ph in enumerate(phases(schedule))
    ]


def pp_report(opts: PPOptions, results: Results) -> dict:
    """Parent side: the single-device reference, the comparison, the bubble (ideal, formula, measured), memory."""
    cfg, schedule = opts.gpt_config(), opts.make_schedule()
    p, m, v = schedule.p, schedule.m, schedule.v
    checks = _numerics(opts, results, schedule)
    sends, theory = _sends(opts, results, schedule)
    bubble_lines, exact, bubble_fields = _bubble(opts, results, schedule)
    peaks = [r["peak_inflight"] for r in results]
    lines = [c.line for c in checks + sends] + bubble_lines
    lines.append(f"peak in-flight (micro-batch, chunk) activations per rank: {peaks}")
    return run_report(
        "pp",
        p,
        checks + sends,
        passed=exact,
        comm={**results.trace.bytes_per_rank(), "theory_send_bytes_per_rank": theory},
        lines=lines + phase_lines(schedule),
        schedule=schedule.name,
        microbatches=m,
        virtual=v,
        layers_per_stage=[len(r) for r in split_layers(cfg.layers, p * v, opts.split or None)],
        **bubble_fields,
        peak_inflight_microbatches=max(peaks),
        peak_inflight_per_rank=peaks,
        peak_inflight_ideal_per_rank=peak_inflight(schedule),
        peak_activation_bytes_per_rank=[r["peak_activation_bytes"] for r in results],
        phases=phases(schedule),
    )


def _numerics(opts: PPOptions, results: Results, schedule: Schedule) -> list:
    """The stages put back together (each weight is held by one stage) against one device; the loss is the last
    stage's, the only one that computes it."""
    cfg = opts.gpt_config()
    return one_device_checks(
        single_device_run(opts),
        cfg.torch_dtype,  # the float32 run is compared with float32's tolerance
        loss=(f"loss of each of {opts.steps} steps", results[schedule.rank_of(schedule.num_stages - 1)]["losses"]),
        grads=("gradients after step 1 (all stages)", {n: g for r in results for n, g in r["grads"].items()}),
        params=(
            f"parameters after {opts.steps} {opts.optimizer.upper()} steps",
            {n: w for r in results for n, w in r["params"].items()},
        ),
    )


def _sends(opts: PPOptions, results: Results, schedule: Schedule) -> tuple[list, list]:
    """The bytes each rank sent against the schedule's messages (one [b, T, H] activation or gradient each).
    Returns (checks, the theory per rank)."""
    cfg, p = opts.gpt_config(), schedule.p
    sent = results.trace.bytes_per_rank().get("send", [0] * p)
    message_bytes = (opts.batch // schedule.m) * cfg.seq_len * cfg.hidden * cfg.dtype_bytes  # one [b, T, H]
    theory = theory_send_bytes(schedule, message_bytes, opts.steps)
    return count_checks([(f"bytes sent by rank {r}", sent[r], theory[r]) for r in range(p)]), theory


def _bubble(opts: PPOptions, results: Results, schedule: Schedule) -> tuple[list[str], bool, dict]:
    """The bubble three ways: ideal (the exact simulation), the textbook formula, measured from the spans.
    Returns (verdict lines, whether ideal = formula where the formula applies, the report fields)."""
    p, m, v, costs = schedule.p, schedule.m, schedule.v, opts.costs or None
    ideal = bubble(simulate(schedule, costs), p)
    formula, formula_text = bubble_formula(schedule.name, p, m, v, costs)
    measured, measured_per_rank = measured_bubble(results.trace)
    if schedule.name in V_SCHEDULES and not formula_holds(schedule.name, p, m, costs):
        exact = True  # the closed form is the ideal bubble only at unit costs and with the V filled: say so
        line = (
            f"ideal bubble {ideal} (exact simulation; the formula {formula_text} = {formula} needs unit "
            "costs and, for zbv, 2m >= 3p - 1)"
        )
    else:
        exact = ideal == formula
        line = (
            f"ideal bubble {ideal} = formula {formula_text} = {formula} (exact fractions): "
            f"{'PASS' if exact else 'FAIL'}"
        )
    fields = {
        "bubble_ideal": float(ideal),
        "bubble_ideal_fraction": str(ideal),
        "bubble_formula": float(formula),
        "bubble_formula_fraction": str(formula),
        "bubble_formula_text": formula_text,
        "bubble_measured": measured,
        "bubble_measured_per_rank": measured_per_rank,
    }
    return [line, f"bubble measured (last step, mean over ranks): {measured:.3f}"], exact, fields


def run_pipeline(schedule: str = "1f1b", world_size: int = 4, microbatches: int = 8, **options) -> tuple[Results, dict]:
    """Run a pipeline schedule on live ranks; returns (results, report) like `python -m parlab run pp --json`.

    options: any PPOptions field (virtual, layers, batch, split, lr, steps, seed, dtype, costs, megatron_warmup).
    """
    return launch_scheme("pp", schedule=schedule, world_size=world_size, microbatches=microbatches, **options)


SCHEMES = [
    Scheme(
        "pp",
        "pipeline parallel: GPipe, 1F1B, interleaved, zero-bubble, ZB-V and DualPipeV schedules, with their bubbles",
        PPOptions,
        pp_rank,
        pp_report,
        quick=(("steps", 1), ("layers", 4), ("microbatches", 4)),  # one block per stage at 4 ranks
    )
]
