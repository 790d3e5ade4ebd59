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

What is communicated, per rank per step: an all-reduce payload of exactly grad_bytes (measured by parlab.core.comm);
a ring all-reduce of N bytes puts 2(P-1)/P x N bytes on each rank's wire (theory, printed beside it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parlab.core import comm, pace
from parlab.core.models import lm_loss

DEFAULT_BUCKET_BYTES = 64 * 1024  # the reference GPT's gradients are 240,640 bytes in float64: 4 buckets
MODES = ("dp", "dp-naive")  # bucketed and overlapped, or one blocking all-reduce per gradient after backward


# ------------------------------------------------------------------------------------- the data: rank r's rows


def shard_batch(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's slice of the global batch: rows [r*b, (r+1)*b) with b = B/P. x, y: [B, T] -> [b, T] each."""
    B = x.shape[0]
    if B % world_size:
        raise ValueError(f"global batch={B} is not divisible by world_size={world_size}")
    b = B // world_size
    return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]  # [b, T], [b, T]


# ----------------------------------------------------------------------------------------------- naive DP


def all_reduce_gradients(model: nn.Module, group=None) -> None:
    """Naive DP: after backward, all-reduce every parameter's gradient over `group` (the data-parallel ranks;
    default all), one blocking call per tensor, then / P.

    gloo has no averaging all-reduce, so: sum over ranks, then divide by P. Afterwards every rank of the group
    holds the same p.grad = (1/P) sum_r g_r for every parameter p.
    """
    P = comm.group_size(group)
    for name, p in model.named_parameters():
        if p.grad is None:  # a parameter this step did not use: its gradient is zero on this rank
            p.grad = torch.zeros_like(p)
        comm.all_reduce(p.grad, group=group, label=name)  # p.grad <- sum over the group's ranks (in place)
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

    def __init__(self, model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, group=None):
        self.model, self.group = model, group  # group: the data-parallel ranks (default all)
        self.world_size = comm.group_size(group)
        named = dict(model.named_parameters())
        self.buckets = [
            Bucket(k, names, [named[n] for n in names]) for k, names in enumerate(plan_buckets(model, bucket_bytes))
        ]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}  # parameter -> its bucket
        self.next_to_start = 0  # the next bucket index to all-reduce this step
        self.numel, self.arrived = sum(b.numel for b in self.buckets), 0  # elements whose gradient has arrived
        self.sync = True  # False inside no_sync(): accumulate locally, communicate nothing
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for b in self.buckets for p in b.params]

    # -- during backward -------------------------------------------------------------------------------------

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Called by autograd right after param.grad has been accumulated, in the middle of backward."""
        if not self.sync:
            return
        bucket = self.bucket_of[id(param)]
        bucket.ready.add(id(param))
        self.arrived += param.numel()
        pace.reached(self.arrived / self.numel)  # an emulated device: backward has done this share of its work
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
            bucket.work = comm.all_reduce(bucket.flat, group=self.group, async_op=True, label=f"bucket {bucket.index}")
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
        self.next_to_start, self.arrived = 0, 0

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


def train_data_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    mode: str = "dp",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    microbatches: int = 1,
    group=None,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    grad_sync: Callable[[], None] | None = None,
) -> dict:
    """Rank code: train `model` with DP over `group` (default all ranks) on this rank's rows of each batch.

    model: this rank's replica (the same weights on every rank of the group). mode: "dp" (bucketed, overlapped)
    or "dp-naive". batches: the GLOBAL batches [B, T], the same list on every rank; rank r of the group slices its
    own b = B/P rows and splits them into M = `microbatches` micro-batches of b/M rows.
    loss_fn(model, x, y): the mean loss of rows x (default: the GPT's next-token loss, lm_loss(model(x), y)).
    grad_sync: called after the DP all-reduce, before the optimizer: another axis' gradient reduction (e.g.
    Megatron SP's LayerNorm gradients over the tp group, in hybrid parallelism).
    Returns this rank's losses (mean over its rows, per step), the averaged gradients of the first step, the
    final parameters and the bucket plan (names per bucket).
    """
    P, rank, M = comm.group_size(group), comm.group_rank(group), microbatches
    loss_fn = loss_fn or (lambda model, x, y: lm_loss(model(x), y))
    bucketed = mode == "dp"
    dp = BucketedDP(model, bucket_bytes, group) if bucketed else None

    losses, first_grads = [], {}
    for step, (x, y) in enumerate(batches):
        x_r, y_r = shard_batch(x, y, rank, P)  # [b, T] each: rank r's rows
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for m, (x_m, y_m) in enumerate(zip(x_r.chunk(M), y_r.chunk(M), strict=True)):  # [b/M, T] each
            last = m == M - 1
            quiet = dp.no_sync() if bucketed and not last else nullcontext()  # communicate after the last one
            with quiet:
                with comm.span("forward", kind="forward", step=step, microbatch=m):
                    loss = loss_fn(model, x_m, y_m) / M  # the mean over this rank's b rows, in M pieces
                with comm.span("backward", kind="backward", step=step, microbatch=m):
                    loss.backward()  # bucketed: the hooks start bucket all-reduces in here
            step_loss += loss.item()
        if bucketed:
            dp.finish()  # wait for the buckets; p.grad = (1/P) sum_r g_r
        else:
            all_reduce_gradients(model, group)  # all-reduce every gradient now; p.grad = (1/P) sum_r g_r
        if grad_sync is not None:
            grad_sync()
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        with comm.span("optimizer step", kind="optimizer", step=step):
            optimizer.step()  # the same averaged gradient on every rank: the replicas stay identical
        losses.append(step_loss)
        comm.progress(step + 1, len(batches))  # the notebook cell shows the slowest rank's step

    return {
        "losses": losses,
        "grads": first_grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buckets": [b.names for b in dp.buckets] if bucketed else [[n] for n, _ in model.named_parameters()],
    }


# ------------------------------------------------------------------------------------------------- the theory


def dp_theory(grad_bytes: int, world_size: int) -> dict:
    """What one DP step must communicate, per rank: an all-reduce payload of grad_bytes, which a ring
    all-reduce sends as 2(P-1)/P x grad_bytes on each rank's wire."""
    P = world_size
    return {
        "theory_payload_bytes_per_step": grad_bytes,
        "theory_ring_wire_bytes_per_step": 2 * (P - 1) * grad_bytes / P,
    }
