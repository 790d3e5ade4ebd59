"""Data parallelism: every rank holds the whole model and trains on its own slice of the batch.

Notation (lesson 01): P ranks, a global batch of B rows, b = B/P rows per rank, M micro-batches per step, Psi
parameters, and grad_bytes = Psi x bytes per element (the size of one full copy of the gradients).

One step of data parallelism (DP):

    rank r takes rows [r*b, (r+1)*b) of the global batch            shard_batch
    forward + backward on those b rows, as if it were alone          (no communication)
    every rank ends with the SAME averaged gradient:
        g = (1/P) sum_r g_r                                           one all-reduce of grad_bytes, then / P
    every rank takes the same optimizer step, so the replicas stay identical.

Because the loss is a mean over rows and every rank has b = B/P rows, (1/P) sum_r g_r is exactly the gradient of
the mean loss over all B rows: DP computes what one device computes on the whole batch, up to rounding.

Two ways to do the all-reduce, both below:
  * naive DP (`all_reduce_gradients`): after backward, one blocking all-reduce per parameter tensor. Simple, but
    the network idles during backward and every small tensor (a LayerNorm bias) pays a full collective's latency.
  * bucketed DP (`BucketedDP`, the idea of PyTorch DDP, Li et al. 2020): gradients are grouped into buckets of
    about `bucket_bytes`, in reverse parameter order (roughly the order backward produces them). A hook on each
    parameter notices when its gradient is ready; when a bucket is full its gradients are flattened into one
    tensor and an asynchronous all-reduce starts, while backward goes on with the earlier layers. Before the
    optimizer step we wait for every bucket, copy the sums back into .grad and divide by P.

Gradient accumulation: with M micro-batches per step each rank runs M forward/backward passes and communicates
only after the last one (`BucketedDP.no_sync`, like DDP's `no_sync`): the gradients summed locally over M
micro-batches are all-reduced once, so the bytes per step do not grow with M.

What is communicated, per rank per step: an all-reduce payload of exactly grad_bytes (measured by parlab.comm);
a ring all-reduce of N bytes puts 2(P-1)/P x N bytes on each rank's wire (theory, printed beside it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from parlab import comm
from parlab.check import check_equal, compare
from parlab.launch import Results, progress
from parlab.models import GPTConfig, build_model, lm_loss, make_batches, make_optimizer, train_single_device
from parlab.schemes import Scheme, launch_scheme
from parlab.trace import Trace

DEFAULT_BUCKET_BYTES = 64 * 1024  # the reference GPT's gradients are 240,640 bytes in float64: 4 buckets
MODES = ("dp", "dp-naive")


# ------------------------------------------------------------------------------------- the data: rank r's rows


def shard_batch(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's slice of the global batch: rows [r*b, (r+1)*b) with b = B/P. x, y: [B, T] -> [b, T] each."""
    B = x.shape[0]
    if B % world_size:
        raise ValueError(f"global batch={B} is not divisible by world_size={world_size}")
    b = B // world_size
    return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]  # [b, T], [b, T]


# ----------------------------------------------------------------------------------------------- naive DP


def all_reduce_gradients(model: nn.Module) -> None:
    """Naive DP: after backward, all-reduce every parameter's gradient, one blocking call per tensor, then / P.

    gloo has no averaging all-reduce, so: sum over ranks, then divide by P. Afterwards every rank holds the same
    p.grad = (1/P) sum_r g_r for every parameter p.
    """
    P = dist.get_world_size()
    for name, p in model.named_parameters():
        if p.grad is None:  # a parameter this step did not use: its gradient is zero on this rank
            p.grad = torch.zeros_like(p)
        comm.all_reduce(p.grad, label=name)  # p.grad <- sum over ranks (in place)
        p.grad.div_(P)


# --------------------------------------------------------------------------------------------- bucketed DP


@dataclass
class Bucket:
    """A group of parameters whose gradients travel in one all-reduce."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)  # ids of the parameters whose gradient arrived this step
    flat: torch.Tensor | None = None  # [numel]: the bucket's gradients side by side, while in flight
    work: object | None = None  # the handle of its asynchronous all-reduce

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def plan_buckets(model: nn.Module, bucket_bytes: int) -> list[list[str]]:
    """Group the parameter names into buckets: walk the parameters in REVERSE order (the last layer's gradients
    are ready first in backward) and close a bucket once it holds at least `bucket_bytes` (like DDP's
    bucket_cap). Returns the names in each bucket, bucket 0 first (the first to be all-reduced)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    buckets: list[list[str]] = [[]]
    filled = 0
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        if filled >= bucket_bytes:  # the current bucket is full: start the next one
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += p.numel() * p.element_size()
    return [b for b in buckets if b]


class BucketedDP:
    """Bucketed data parallelism with the all-reduces overlapped with backward.

        dp = BucketedDP(model, bucket_bytes=64 * 1024)   # same model (same seed) on every rank
        loss.backward()       # hooks start "bucket 0", "bucket 1", ... as their gradients become ready
        dp.finish()           # wait for every bucket; p.grad = (1/P) sum_r g_r on every rank
        opt.step()

    Buckets are started in index order on every rank (a collective is matched by the order of calls, so all
    ranks must start bucket k as their k-th all-reduce); a bucket that is complete before an earlier one waits
    for it. Each rank keeps a full copy of the model and of the gradients (Psi each): that is what ZeRO removes.
    """

    def __init__(self, model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.model = model
        self.world_size = dist.get_world_size()
        named = dict(model.named_parameters())
        self.buckets = [
            Bucket(k, names, [named[n] for n in names]) for k, names in enumerate(plan_buckets(model, bucket_bytes))
        ]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}  # parameter -> its bucket
        self.next_to_start = 0  # the next bucket index to all-reduce this step
        self.sync = True  # False inside no_sync(): accumulate locally, communicate nothing
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for b in self.buckets for p in b.params]

    # -- during backward -------------------------------------------------------------------------------------

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Called by autograd right after param.grad has been accumulated, in the middle of backward."""
        if not self.sync:
            return
        bucket = self.bucket_of[id(param)]
        bucket.ready.add(id(param))
        self._start_ready_buckets()
        self._note_finished()

    def _start_ready_buckets(self, force: bool = False) -> None:
        """Start the all-reduce of every complete bucket whose predecessors have all started (in index order)."""
        while self.next_to_start < len(self.buckets):
            bucket = self.buckets[self.next_to_start]
            if not force and len(bucket.ready) < len(bucket.params):
                return
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in bucket.params]
            bucket.flat = torch.cat([g.reshape(-1) for g in grads])  # [numel of the bucket]
            bucket.work = comm.all_reduce(bucket.flat, async_op=True, label=f"bucket {bucket.index}")
            self.next_to_start += 1

    def _note_finished(self) -> None:
        """Close the timeline bar of every all-reduce already done, so its bar ends about when the data arrived
        (a bar otherwise ends when finish() waits for it)."""
        for bucket in self.buckets[: self.next_to_start]:
            if bucket.work is not None and bucket.work.event.end is None and bucket.work.is_completed():
                bucket.work.wait()  # returns at once and records the end time

    # -- after backward ----------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for every bucket, copy the summed gradients back into .grad and divide by P.

        After this, every rank holds p.grad = (1/P) sum_r g_r for every parameter p."""
        self._start_ready_buckets(force=True)  # buckets with a parameter this step did not use (zero gradient)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.flat.div_(self.world_size)  # sum over ranks -> mean
            offset = 0
            for p in bucket.params:  # unflatten: slice [offset, offset + numel) of the bucket is p's gradient
                g = bucket.flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                offset += p.numel()
            bucket.ready.clear()
            bucket.flat, bucket.work = None, None
        self.next_to_start = 0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block only accumulate gradients locally (for gradient accumulation):
        the hooks do nothing, and the next backward outside it all-reduces the accumulated sums."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def remove(self) -> None:
        """Detach the hooks (the model trains alone again)."""
        for hook in self.hooks:
            hook.remove()


# ---------------------------------------------------------------------------------------- the training loop


def model_config(opts: dict) -> GPTConfig:
    """The reference GPT at the size the options ask for."""
    return GPTConfig(layers=opts.get("layers", 2), hidden=opts.get("hidden", 32), dtype=opts["dtype"])


def train_data_parallel(opts: dict, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Rank code: train the GPT with DP (opts["mode"]: "dp" bucketed, or "dp-naive") on this rank's rows.

    batches: the GLOBAL batches [B, T], the same list on every rank; each rank slices its own b = B/P rows and
    splits them into M micro-batches of b/M rows. Returns this rank's losses (mean over its rows, per step),
    the averaged gradients of the first step, the final parameters and the bucket plan.
    """
    P, rank, M = dist.get_world_size(), dist.get_rank(), opts.get("microbatches", 1)
    model = build_model(model_config(opts), opts["seed"])  # the same weights on every rank (same seed)
    opt = make_optimizer(model.parameters(), "sgd", opts.get("lr", 0.1))
    bucketed = opts.get("mode", "dp") == "dp"
    dp = BucketedDP(model, opts.get("bucket_bytes", DEFAULT_BUCKET_BYTES)) if bucketed else None

    losses, first_grads = [], {}
    for step, (x, y) in enumerate(batches):
        x_r, y_r = shard_batch(x, y, rank, P)  # [b, T] each: rank r's rows
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for m, (x_m, y_m) in enumerate(zip(x_r.chunk(M), y_r.chunk(M), strict=True)):  # [b/M, T] each
            last = m == M - 1
            quiet = dp.no_sync() if bucketed and not last else nullcontext()  # communicate after the last one
            with quiet:
                with comm.span("forward", kind="forward", step=step, microbatch=m):
                    loss = lm_loss(model(x_m), y_m) / M  # the mean over this rank's b rows, in M pieces
                with comm.span("backward", kind="backward", step=step, microbatch=m):
                    loss.backward()  # bucketed: the hooks start bucket all-reduces in here
            step_loss += loss.item()
        if bucketed:
            dp.finish()  # wait for the buckets; p.grad = (1/P) sum_r g_r
        else:
            all_reduce_gradients(model)  # all-reduce every gradient now; p.grad = (1/P) sum_r g_r
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        with comm.span("SGD step", kind="optimizer", step=step):
            opt.step()  # the same averaged gradient on every rank: the replicas stay identical
        losses.append(step_loss)
        progress(step + 1, len(batches))  # the notebook cell shows the slowest rank's step

    return {
        "losses": losses,
        "grads": first_grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buckets": [b.names for b in dp.buckets] if bucketed else [[n] for n, _ in model.named_parameters()],
    }


def train_torch_ddp(opts: dict, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The same training with torch.nn.parallel.DistributedDataParallel, for comparison (rank code).

    DDP talks to torch.distributed itself, so nothing here is traced: the parlab trace shows only our DP."""
    from torch.nn.parallel import DistributedDataParallel

    P, rank, M = dist.get_world_size(), dist.get_rank(), opts.get("microbatches", 1)
    model = build_model(model_config(opts), opts["seed"])
    bucket_mb = opts.get("bucket_bytes", DEFAULT_BUCKET_BYTES) / 2**20
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = make_optimizer(ddp.parameters(), "sgd", opts.get("lr", 0.1))
    losses = []
    for x, y in batches:
        x_r, y_r = shard_batch(x, y, rank, P)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for m, (x_m, y_m) in enumerate(zip(x_r.chunk(M), y_r.chunk(M), strict=True)):
            with ddp.no_sync() if m < M - 1 else nullcontext():
                loss = lm_loss(ddp(x_m), y_m) / M
                loss.backward()
            step_loss += loss.item()
        opt.step()
        losses.append(step_loss)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def dp_rank(opts: dict) -> dict:
    """The scheme's rank code: our DP (traced), then torch DDP on the same data (untraced) unless opts["ddp"]
    is False."""
    batches = make_batches(model_config(opts), opts["batch"], opts["steps"], opts["seed"])  # global [B, T]
    out = train_data_parallel(opts, batches)
    if opts.get("ddp", True):
        out["ddp"] = train_torch_ddp(opts, batches)
    return out


# ----------------------------------------------------------------------------- the parent: checks and report


def check_options(opts: dict) -> None:
    """Reject options that cannot work, before any process starts."""
    P, B, M = opts["world"], opts["batch"], opts.get("microbatches", 1)
    if P < 1:
        raise ValueError(f"world={P} must be >= 1")
    if opts.get("mode", "dp") not in MODES:
        raise ValueError(f"mode={opts.get('mode')!r} must be one of {MODES}")
    if opts["steps"] < 1:
        raise ValueError(f"steps={opts['steps']} must be >= 1")
    if B < 1 or B % P:
        raise ValueError(f"global batch={B} is not divisible by world_size={P}")
    if M < 1 or (B // P) % M:
        raise ValueError(
            f"the {B // P} rows per rank (batch={B} / world_size={P}) are not divisible by microbatches={M}"
        )
    if opts.get("bucket_bytes", DEFAULT_BUCKET_BYTES) <= 0:
        raise ValueError(f"bucket_bytes={opts['bucket_bytes']} must be > 0")
    model_config(opts)  # e.g. hidden not divisible by heads


def dp_theory(grad_bytes: int, world_size: int) -> dict:
    """What one DP step must communicate, per rank: an all-reduce payload of grad_bytes, which a ring
    all-reduce sends as 2(P-1)/P x grad_bytes on each rank's wire."""
    P = world_size
    return {
        "theory_payload_bytes_per_step": grad_bytes,
        "theory_ring_wire_bytes_per_step": 2 * (P - 1) * grad_bytes / P,
    }


def step_trace(trace: Trace, step: int) -> Trace:
    """The events of one training step: on each rank, from its first forward of `step` to the end of its
    optimizer step (the bucket all-reduces in between included)."""
    events = []
    for rank in range(trace.world_size):
        mine = trace.select(rank=rank)
        spans = [e for e in mine if e.is_compute and e.extra.get("step") == step]
        if not spans:
            continue
        start, end = min(e.start for e in spans), max(e.start + e.duration for e in spans)
        events += [e for e in mine if start <= e.start <= end]
    return Trace(events, trace.world_size)


def overlapped_all_reduces(trace: Trace, rank: int = 0) -> tuple[int, int]:
    """(all-reduces started while a backward span was running, all all-reduces) on one rank."""
    backward = trace.select(kind="backward", rank=rank)
    reduces = trace.select(kind="all_reduce", rank=rank)
    inside = [e for e in reduces if any(b.start <= e.start <= b.start + b.duration for b in backward)]
    return len(inside), len(reduces)


def _as_tensors(losses: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(losses, dtype=dtype)


def dp_report(opts: dict, results: Results) -> dict:
    """Run the single-device reference on the same global batches and compare; count the bytes."""
    P, K, mode = opts["world"], opts["steps"], opts.get("mode", "dp")
    cfg = model_config(opts)
    batches = make_batches(cfg, opts["batch"], K, opts["seed"])
    single = train_single_device(cfg, batches, opts["seed"], "sgd", opts.get("lr", 0.1))
    dtype = cfg.torch_dtype

    # The loss of a step is the mean over all B rows: the mean of the P ranks' means (equal b on every rank).
    loss_parallel = [sum(r["losses"][k] for r in results) / P for k in range(K)]
    verdicts = [
        compare(
            f"loss of each of {K} steps",
            _as_tensors(loss_parallel, dtype),
            _as_tensors(single.losses, dtype),
            show=False,
        ),
        compare(
            "averaged gradients of step 1, every rank", [r["grads"] for r in results], [single.grads] * P, show=False
        ),
        compare(
            f"parameters after {K} steps, every rank", [r["params"] for r in results], [single.params] * P, show=False
        ),
    ]
    ddp_lines = []
    if "ddp" in results[0]:
        ddp = [r["ddp"] for r in results]
        loss_ddp = [sum(d["losses"][k] for d in ddp) / P for k in range(K)]
        versus_ddp = [
            compare(
                "torch DDP vs our DP: loss of each step",
                _as_tensors(loss_parallel, dtype),
                _as_tensors(loss_ddp, dtype),
                show=False,
                against="torch DDP",
            ),
            compare(
                "torch DDP vs our DP: parameters, every rank",
                [r["params"] for r in results],
                [d["params"] for d in ddp],
                show=False,
                against="torch DDP",
            ),
        ]
        verdicts += versus_ddp
        ddp_lines = [v.line for v in versus_ddp]

    # Measured communication: the payload every rank handed to all_reduce, per step, against grad_bytes.
    grad_bytes = sum(p.numel() * p.element_size() for p in results[0]["params"].values())
    comm_bytes = results.trace.bytes_per_rank()
    per_step = [b / K for b in comm_bytes.get("all_reduce", [0] * P)]
    buckets_per_step = len(results[0]["buckets"])
    calls_per_step = [c / K for c in results.trace.count_per_rank("all_reduce")]
    byte_checks = [
        check_equal(f"all-reduce payload per step, rank {r}", per_step[r], grad_bytes, show=False) for r in range(P)
    ]
    call_what = "buckets" if mode == "dp" else "parameter tensors"
    call_checks = [
        check_equal(f"all-reduces per step, rank {r} (= {call_what})", calls_per_step[r], buckets_per_step, show=False)
        for r in range(P)
    ]
    checks = verdicts + byte_checks + call_checks
    worst = max(verdicts, key=lambda v: v.max_abs_err)
    lines = [v.line for v in verdicts[:3]] + ddp_lines + [c.line for c in byte_checks + call_checks]
    return {
        "scheme": mode,
        "world_size": P,
        "passed": all(c.passed for c in checks),
        "max_abs_err": worst.max_abs_err,
        "tol": worst.tol,
        "comm": {**comm_bytes, "all_reduce_per_step": per_step, **dp_theory(grad_bytes, P)},
        "verdicts": lines,
        "steps": K,
        "loss_single": single.losses,
        "loss_parallel": loss_parallel,
        "loss_ddp": loss_ddp if ddp_lines else None,
        "grad_bytes": grad_bytes,
        "buckets_per_step": buckets_per_step,
        "bucket_bytes": opts.get("bucket_bytes", DEFAULT_BUCKET_BYTES) if mode == "dp" else None,
        "buckets": results[0]["buckets"],
        "batch": opts["batch"],
        "microbatches": opts.get("microbatches", 1),
    }


# ------------------------------------------------------------------------------------------ from a notebook


def run_dp(world_size: int = 4, mode: str = "dp", **opts) -> tuple[Results, dict]:
    """Run DP on live ranks; returns (results, report), the report being what `python -m parlab run dp` prints.

    opts: steps, batch, microbatches, bucket_bytes, lr, layers, hidden, dtype, seed, ddp (compare with torch DDP).
    """
    return launch_scheme(mode, world=world_size, **opts)


def draw_loss_curves(report: dict):
    """Plotly figure: the loss of each step on one device, with our DP and with torch DDP, overlaid."""
    import plotly.graph_objects as go

    from parlab import plots

    steps = list(range(1, report["steps"] + 1))
    P = report["world_size"]
    fig = go.Figure()
    curves = [
        ("one device, full batch", report["loss_single"], plots.SERIES_COLORS["single device"], "solid", 6),
        (f"our DP, {P} ranks", report["loss_parallel"], plots.SERIES_COLORS["parlab"], "dash", 3),
    ]
    if report.get("loss_ddp"):
        color = plots.SERIES_COLORS["other library"]
        curves.append((f"torch DDP, {P} ranks", report["loss_ddp"], color, "dot", 3))
    for name, losses, color, dash, width in curves:
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=losses,
                name=name,
                mode="lines+markers",
                line={"color": color, "dash": dash, "width": width},
                hovertemplate=f"{name}<br>step %{{x}}<br>loss %{{y:.12f}}<extra></extra>",
            )
        )
    title = f"Training loss, global batch {report['batch']}: one device vs {P} data-parallel ranks"
    fig.update_xaxes(dtick=1 if report["steps"] <= 20 else None)
    return plots.style(fig, title, "step", "cross-entropy loss (nats)")


def draw_step(trace: Trace, step: int, title: str):
    """Plotly timeline of one training step, every rank (parlab.plots.timeline): compute spans (forward,
    backward, optimizer) in the upper half of each rank's row, all-reduces below them, buckets in flight at the
    same time in stacked lanes. Times measured in the ranks."""
    from parlab import plots

    return plots.timeline(step_trace(trace, step), title)


# ---------------------------------------------------------------------------------------------- the schemes

DEFAULTS = {
    "batch": 8,
    "microbatches": 1,
    "bucket_bytes": DEFAULT_BUCKET_BYTES,
    "lr": 0.1,
    "layers": 2,
    "hidden": 32,
    "ddp": True,
}


def _add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="global batch (rows over all ranks)")
    parser.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation micro-batches per step")
    parser.add_argument("--bucket-bytes", dest="bucket_bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="SGD learning rate")
    parser.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="transformer blocks")
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="hidden size")
    parser.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the torch DDP comparison")


def _scheme(mode: str, help_text: str) -> Scheme:
    # Both schemes share the rank code and the report; opts["mode"] ("dp" or "dp-naive") tells them apart.
    return Scheme(
        name=mode,
        help=help_text,
        rank_fn=dp_rank,
        report=dp_report,
        add_arguments=_add_arguments,
        check=check_options,
        defaults={**DEFAULTS, "mode": mode},
    )


SCHEMES = [
    _scheme("dp", "data parallel, bucketed all-reduces overlapped with backward; vs one device and torch DDP"),
    _scheme("dp-naive", "data parallel, one blocking all-reduce per gradient after backward"),
]
