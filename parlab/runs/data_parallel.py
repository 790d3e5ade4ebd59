"""Run and check data parallelism (parlab/schemes/data_parallel.py): `python -m parlab run dp` and `run dp-naive`.

The ranks train with our DP (traced), then with torch's DistributedDataParallel on the same data (untraced); the
parent trains one device on the whole batch and compares losses, gradients and parameters with both, and the
all-reduce payload with grad_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from parlab.core.check import compare
from parlab.core.comm import device
from parlab.core.models import build_model, make_batches, make_optimizer
from parlab.runs.options import FaultOptions, ModelOptions, option, positive
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import (
    compare_losses,
    count_checks,
    mean_losses,
    one_device_checks,
    run_report,
    single_device_run,
)
from parlab.runtime.errors import Results
from parlab.schemes.data_parallel import DEFAULT_BUCKET_BYTES, MODES, dp_theory, train_data_parallel
from parlab.twins.data import train_torch_ddp


@dataclass
class DPOptions(FaultOptions, ModelOptions):
    mode: str = option("dp", "dp (bucketed, overlapped) or dp-naive (one all-reduce per gradient)", choices=MODES)
    microbatches: int = option(1, "gradient-accumulation micro-batches per step")
    bucket_bytes: int = option(DEFAULT_BUCKET_BYTES, "bytes per gradient bucket (bucketed DP)")
    ddp: bool = option(True, "also train with torch DDP and compare (--no-ddp skips it)")

    def validate(self) -> None:
        super().validate()
        P, B, M = self.world_size, self.batch, self.microbatches
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")
        positive("microbatches", M)
        if B % P:
            raise ValueError(f"global batch={B} is not divisible by world_size={P}")
        if (B // P) % M:
            raise ValueError(
                f"the {B // P} rows per rank (batch={B} / world_size={P}) are not divisible by microbatches={M}"
            )
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} must be > 0")


def dp_rank(opts: DPOptions) -> dict:
    """Rank code: our DP (traced), then torch DDP on the same data (untraced) unless opts.ddp is False."""
    cfg, dev = opts.gpt_config(), device()  # dev: this rank's GPU under NCCL, else the CPU
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)  # global [B, T], the same everywhere
    model = build_model(cfg, opts.seed, device=dev)  # the same weights on every rank (same seed)
    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    out = train_data_parallel(
        model, optimizer, batches, mode=opts.mode, bucket_bytes=opts.bucket_bytes, microbatches=opts.microbatches
    )
    if opts.ddp:
        out["ddp"] = train_torch_ddp(opts, batches)
    return out


def dp_report(opts: DPOptions, results: Results) -> dict:
    """Run the single-device reference on the same global batches and compare; count the bytes."""
    P, K = opts.world_size, opts.steps
    single = single_device_run(opts)
    loss_parallel = mean_losses(results, K)  # the mean over all B rows: the mean of the P ranks' means (equal b)
    checks = one_device_checks(
        single,
        opts.gpt_config().torch_dtype,
        loss=(f"loss of each of {K} steps", loss_parallel),
        grads=("averaged gradients of step 1, every rank", [r["grads"] for r in results]),
        params=(f"parameters after {K} steps, every rank", [r["params"] for r in results]),
        ranks=P,
    )
    loss_ddp = None
    if opts.ddp:
        ddp_checks, loss_ddp = _versus_ddp(opts, results, loss_parallel)
        checks += ddp_checks
    traffic, comm, grad_bytes = _traffic(opts, results)
    return run_report(
        opts.mode,
        P,
        checks + traffic,
        comm=comm,
        steps=K,
        loss_single=single.losses,
        loss_parallel=loss_parallel,
        loss_ddp=loss_ddp,
        grad_bytes=grad_bytes,
        buckets_per_step=len(results[0]["buckets"]),
        bucket_bytes=opts.bucket_bytes if opts.mode == "dp" else None,
        buckets=results[0]["buckets"],
        batch=opts.batch,
        microbatches=opts.microbatches,
    )


def _versus_ddp(opts: DPOptions, results: Results, loss_parallel: list[float]) -> tuple[list, list[float]]:
    """Our DP against torch's DistributedDataParallel on the same data: (the verdicts, DDP's loss of each step).
    Both sum the same gradients, so they agree as closely as with one device."""
    ddp = [r["ddp"] for r in results]
    loss_ddp = mean_losses(ddp, opts.steps)
    checks = [
        compare_losses(
            "torch DDP vs our DP: loss of each step",
            loss_parallel,
            loss_ddp,
            opts.gpt_config().torch_dtype,
            against="torch DDP",
        ),
        compare(
            "torch DDP vs our DP: parameters, every rank",
            [r["params"] for r in results],
            [d["params"] for d in ddp],
            against="torch DDP",
        ),
    ]
    return checks, loss_ddp


def _traffic(opts: DPOptions, results: Results) -> tuple[list, dict, int]:
    """The all-reduces each rank made per step: the payload (= every gradient's bytes, once) and the calls
    (= the buckets, or one per parameter tensor in dp-naive). Returns (checks, comm figures, gradient bytes)."""
    P, K = opts.world_size, opts.steps
    grad_bytes = sum(p.numel() * p.element_size() for p in results[0]["params"].values())
    comm_bytes = results.trace.bytes_per_rank()
    per_step = [b / K for b in comm_bytes.get("all_reduce", [0] * P)]
    calls_per_step = [c / K for c in results.trace.count_per_rank("all_reduce")]
    buckets_per_step = len(results[0]["buckets"])
    call_what = "buckets" if opts.mode == "dp" else "parameter tensors"
    rows = [(f"all-reduce payload per step, rank {r}", per_step[r], grad_bytes) for r in range(P)]
    rows += [(f"all-reduces per step, rank {r} (= {call_what})", calls_per_step[r], buckets_per_step) for r in range(P)]
    comm = {**comm_bytes, "all_reduce_per_step": per_step, **dp_theory(grad_bytes, P)}
    return count_checks(rows), comm, grad_bytes


def run_dp(world_size: int = 4, mode: str = "dp", **options) -> tuple[Results, dict]:
    """Run DP on live ranks; returns (results, report), the report being what `python -m parlab run dp` prints.

    options: any DPOptions field (steps, batch, microbatches, bucket_bytes, lr, layers, hidden, dtype, seed, ddp).
    """
    return launch_scheme(mode, world_size=world_size, **options)


SCHEMES = [
    Scheme(
        "dp",
        "data parallel, bucketed all-reduces overlapped with backward; vs one device and torch DDP",
        DPOptions,
        dp_rank,
        dp_report,
        fixed=(("mode", "dp"),),
        failure="dp",
        quick=(("steps", 1), ("layers", 1)),
    ),
    Scheme(
        "dp-naive",
        "data parallel, one blocking all-reduce per gradient after backward",
        DPOptions,
        dp_rank,
        dp_report,
        fixed=(("mode", "dp-naive"),),
        failure="dp",
        quick=(("steps", 1), ("layers", 1)),
    ),
]
