"""Traced collectives: `torch.distributed`, plus a record of every call.

Every scheme in parlab communicates through these functions, never through `torch.distributed` directly, so
that each byte it moves is counted from the tensors it actually passes and every call lands on the timeline.
Each function has the name and arguments of its `torch.distributed` twin, plus an optional `label` that shows
on the timeline ("bucket 2", "mb 3").

    from parlab.core import comm
    comm.all_reduce(grad, label="bucket 0")       # like dist.all_reduce(grad), and recorded
    with comm.span("F mb3", kind="forward"):      # a compute span on the timeline
        y = stage(x)

What `bytes` means, per call (the payload this rank hands to torch.distributed):
    all_reduce, broadcast, reduce, all_to_all: the tensor(s) passed in
    all_gather: this rank's input (its contribution); reduce_scatter: the whole input this rank reduces
    send: the tensor sent; recv: the tensor received
What goes over the wire depends on the algorithm the backend picks: for a ring all-reduce of N bytes each rank
sends 2(P-1)/P x N, which is why lessons print that theory beside the measured payload.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from parlab.core import pace
from parlab.core.trace import Event

ReduceOp = dist.ReduceOp

_events: list[Event] = []

# Hang diagnosis: parlab.launch sets `call_hook` in each rank to publish the traced call the rank is in:
# call_hook(event, index, state) with state "waiting" when the rank enters its call #index (or waits for it),
# "waiting again" when it calls wait() once more on a handle it has already waited for (gloo's wait() on a finished
# send or receive does not return), "in flight" when an asynchronous call has been issued, "done" once its data is
# here. None elsewhere.
call_hook = None
_calls = 0  # the traced communication calls this rank has made

# Progress: the launcher sets `progress_hook` in each rank (a function of one dict) so that a scheme's loop can say
# how far it is without knowing who runs it. None elsewhere (e.g. under torchrun): progress() is then a no-op.
progress_hook = None

# Live timelines (parlab.live): in a rank, the launcher sets `event_hook` (a function of this rank's event list) when
# the parent asked for a live view; it is called as each event is recorded and streams them to the parent (throttled).
# In the parent, parlab.live sets `event_sink`: the launcher hands it what the ranks streamed, and None as a tick.
event_hook = None
event_sink = None


def progress(done: int, total: int, what: str = "step") -> None:
    """Rank code: say how far this rank is ("step 3 of 10"); while the ranks run, the cell shows the slowest rank."""
    if progress_hook is not None:
        progress_hook({"rank": dist.get_rank(), "done": done, "total": total, "what": what})


# torch 2.13 renamed the single-tensor collectives; older releases (>= 2.4) have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reset_trace() -> None:
    """Forget this rank's events (parlab.launch does this before running the rank function)."""
    global _calls
    _events.clear()
    _calls = 0


def trace_events() -> list[Event]:
    """This rank's events so far."""
    return list(_events)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _nbytes(tensors: torch.Tensor | Sequence[torch.Tensor]) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


def _group_ranks(group) -> tuple[int, ...] | None:
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def _axis(group) -> str | None:
    """The device-mesh axis a group belongs to ("dp", "tp", ...), from the name torch's DeviceMesh gives it."""
    desc = getattr(group, "group_desc", "") if group is not None else ""
    return desc.removeprefix("mesh_") if desc.startswith("mesh_") else None


def device(group=None) -> torch.device:
    """The device this rank's tensors live on: its own GPU under NCCL, else the CPU (parlab.device()).

    group: the device of that group's collectives (default: the whole world's). Every tensor a rank hands to a
    collective must be on it: NCCL refuses a CPU tensor ("No backend type associated with device type cpu"), and
    parlab's gloo runs keep everything on the CPU. The traced calls below check it (see `check_device`)."""
    if dist.is_initialized() and _backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backend(group) -> str:
    """The backend of `group` ("gloo", "nccl"); a function of its own so that a test can pretend to be NCCL."""
    return dist.get_backend(group)


class DeviceMismatch(RuntimeError):
    """A tensor handed to a traced collective is not on the device of the group it is handed to."""


def check_device(what: str, group, tensors: Sequence[torch.Tensor]) -> None:
    """Refuse, before torch.distributed sees it, a tensor that is not on `group`'s device (see `device`).

    NCCL's own error for a CPU tensor names neither the tensor nor the line that made it; this one names the call
    and the line of the scheme (the first caller outside this file) that handed it over."""
    if not dist.is_initialized():
        return
    backend = _backend(group)
    if backend not in ("gloo", "nccl"):  # a mixed backend ("cpu:gloo,cuda:nccl") takes either device
        return
    expected = device(group)
    for tensor in tensors:
        if tensor.device != expected:
            raise DeviceMismatch(
                f"comm.{what}: a tensor on {tensor.device}, but this rank's {backend} group works on {expected}"
                f"{' (NCCL refuses CPU tensors)' if backend == 'nccl' else ''}: make it on parlab.device() "
                f"(draw on the host with the seeded generator, then .to(parlab.device())); "
                f"handed over at {_caller()}"
            )


def _caller() -> str:
    """'path:line (function)' of the first frame outside this file: the scheme's line that made the call."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "an unknown place"
    path = Path(frame.f_code.co_filename)
    root = Path(__file__).resolve().parents[2]  # the folder that holds the parlab package
    try:
        path = path.resolve().relative_to(root)
    except ValueError:  # outside the repository (a notebook cell, a script): the path as Python has it
        pass
    return f"{path.as_posix()}:{frame.f_lineno} ({frame.f_code.co_name})"


def group_rank(group=None) -> int:
    """This process's rank within `group` (None: the whole world); 0 outside torch.distributed."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_size(group=None) -> int:
    """The number of ranks in `group` (None: the whole world); 1 outside torch.distributed."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def global_rank(group, rank_in_group: int) -> int:
    """The global rank of the process that is rank `rank_in_group` of `group` (send/recv address global ranks)."""
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


def _sync(tensor: torch.Tensor) -> None:
    # GPU work is asynchronous: wait for it so that the recorded end time is when the data really arrived.
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class _TracedWork:
    """Wraps the handle of an asynchronous operation: its event ends when someone waits for it."""

    def __init__(self, work, event: Event, tensor: torch.Tensor, index: int = 0):
        self.work, self.event, self.tensor, self.index = work, event, tensor, index
        self.waited = False  # a wait() has returned: a second one is a wait on a finished handle

    def wait(self) -> bool:
        _hook(self.event, self.index, "waiting again" if self.waited else "waiting")
        try:
            result = self.work.wait()
            _sync(self.tensor)
            self.waited = True
        finally:
            _hook(self.event, self.index, "done")  # the data is here (or the wait failed): no rank to wait for
        if self.event.end is None:
            pace.hold_comm(self.event)  # an emulated link: the data arrives when the link model says
            self.event.end = time.perf_counter()
        return result

    def is_completed(self) -> bool:
        # Under an emulated link (parlab.core.pace) the data counts as arrived only when the link model says so.
        return self.work.is_completed() and time.perf_counter() >= pace.comm_ready_at(self.event)


def _run(kind, call, tensor, nbytes, async_op, label="", peer=None, group=None):
    """Issue one torch.distributed call and record it."""
    event = Event(
        _rank(),
        kind,
        time.perf_counter(),
        bytes=nbytes,
        label=label,
        peer=peer,
        group=_group_ranks(group),
        axis=_axis(group),
        device=None if kind == "barrier" else str(tensor.device),  # (a barrier's marker is never handed over)
    )
    _events.append(event)
    if event_hook is not None:
        event_hook(_events)
    pace.issue_comm(event)  # an emulated link (parlab.core.pace): when this message will have arrived
    global _calls
    _calls += 1
    index = _calls
    _hook(event, index, "waiting")
    try:
        work = call()
        if not async_op:
            _sync(tensor)
    except BaseException:
        _hook(event, index, "done")  # the call failed: the rank no longer waits in it
        raise
    if async_op:
        _hook(event, index, "in flight")  # completes in the background until someone waits for it
        return _TracedWork(work, event, tensor, index)
    _hook(event, index, "done")  # the data is here: what follows waits for no other rank
    if kind == "recv" and peer is None:
        event.peer = work  # a receive from any rank: dist.recv returned the sender's (global) rank
    pace.hold_comm(event)
    event.end = time.perf_counter()
    return work  # what torch.distributed returned (None for the collectives)


def _hook(event: Event, index: int, state: str) -> None:
    if call_hook is not None:
        call_hook(event, index, state)


# ------------------------------------------------------------------------------------------------ collectives


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, label=""):
    """Every rank ends with the reduction (sum by default) of all ranks' `tensor`, in place."""
    check_device("all_reduce", group, [tensor])
    call = lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op)  # noqa: E731
    return _run("all_reduce", call, tensor, _nbytes(tensor), async_op, label, group=group)


def broadcast(tensor, src, group=None, async_op=False, label=""):
    """Every rank ends with rank `src`'s `tensor`, in place."""
    check_device("broadcast", group, [tensor])
    call = lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op)  # noqa: E731
    return _run("broadcast", call, tensor, _nbytes(tensor), async_op, label, peer=src, group=group)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, label=""):
    """Rank `dst` ends with the reduction of all ranks' `tensor`."""
    check_device("reduce", group, [tensor])
    call = lambda: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)  # noqa: E731
    return _run("reduce", call, tensor, _nbytes(tensor), async_op, label, peer=dst, group=group)


def all_gather(tensor_list, tensor, group=None, async_op=False, label=""):
    """tensor_list[r] <- rank r's `tensor`, on every rank."""
    check_device("all_gather", group, [*tensor_list, tensor])
    call = lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)  # noqa: E731
    return _run("all_gather", call, tensor, _nbytes(tensor), async_op, label, group=group)


def all_gather_into_tensor(output, tensor, group=None, async_op=False, label=""):
    """output = concatenation of every rank's `tensor` along dim 0, on every rank."""
    check_device("all_gather_into_tensor", group, [output, tensor])
    call = lambda: _all_gather_single(output, tensor, group=group, async_op=async_op)  # noqa: E731
    return _run("all_gather", call, output, _nbytes(tensor), async_op, label, group=group)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, label=""):
    """Rank r's `output` <- the reduction over ranks of their input_list[r]."""
    check_device("reduce_scatter", group, [output, *input_list])
    call = lambda: dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)  # noqa: E731
    return _run("reduce_scatter", call, output, _nbytes(input_list), async_op, label, group=group)


def reduce_scatter_tensor(output, tensor, op=ReduceOp.SUM, group=None, async_op=False, label=""):
    """Rank r's `output` <- the reduction over ranks of chunk r (along dim 0) of their `tensor`."""
    check_device("reduce_scatter_tensor", group, [output, tensor])
    call = lambda: _reduce_scatter_single(output, tensor, op=op, group=group, async_op=async_op)  # noqa: E731
    return _run("reduce_scatter", call, output, _nbytes(tensor), async_op, label, group=group)


def all_to_all(output_list, input_list, group=None, async_op=False, label=""):
    """output_list[s] on rank r <- input_list[r] of rank s: every rank sends one chunk to every rank."""
    check_device("all_to_all", group, [*output_list, *input_list])
    call = lambda: dist.all_to_all(output_list, input_list, group=group, async_op=async_op)  # noqa: E731
    return _run("all_to_all", call, output_list[0], _nbytes(input_list), async_op, label, group=group)


def all_to_all_single(
    output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False, label=""
):
    """Like all_to_all with the chunks taken along dim 0 of one tensor: equal chunks, or uneven ones given by the
    split sizes (rows of `tensor` for each rank, rows of `output` from each rank; expert parallelism's tokens)."""
    check_device("all_to_all_single", group, [output, tensor])
    call = lambda: dist.all_to_all_single(  # noqa: E731
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )
    return _run("all_to_all", call, output, _nbytes(tensor), async_op, label, group=group)


def barrier(group=None, label=""):
    """Wait until every rank of the group gets here (no payload)."""
    marker = torch.zeros(0)  # host: an empty marker for the trace, never handed to torch.distributed
    return _run("barrier", lambda: dist.barrier(group=group), marker, 0, False, label, group=group)


# --------------------------------------------------------------------------------------------- point to point


def send(tensor, dst, group=None, label=""):
    """Send `tensor` to rank `dst`; returns once the data has left this rank."""
    check_device("send", group, [tensor])
    call = lambda: dist.send(tensor, dst=dst, group=group)  # noqa: E731
    return _run("send", call, tensor, _nbytes(tensor), False, label, dst, group)


def recv(tensor, src, group=None, label=""):
    """Receive into `tensor` from rank `src` (None: from whichever rank sends first); returns the sender's
    global rank, as dist.recv does."""
    check_device("recv", group, [tensor])
    call = lambda: dist.recv(tensor, src=src, group=group)  # noqa: E731
    return _run("recv", call, tensor, _nbytes(tensor), False, label, src, group)


def isend(tensor, dst, group=None, label=""):
    """Start sending `tensor` to rank `dst`; call .wait() on the result before reusing `tensor`."""
    check_device("isend", group, [tensor])
    call = lambda: dist.isend(tensor, dst=dst, group=group)  # noqa: E731
    return _run("send", call, tensor, _nbytes(tensor), True, label, dst, group)


def irecv(tensor, src, group=None, label=""):
    """Start receiving into `tensor` from rank `src`; call .wait() before reading it."""
    check_device("irecv", group, [tensor])
    call = lambda: dist.irecv(tensor, src=src, group=group)  # noqa: E731
    return _run("recv", call, tensor, _nbytes(tensor), True, label, src, group)


def wait_all(works) -> None:
    """Wait for every handle returned by the asynchronous calls above."""
    for work in works:
        work.wait()


# ------------------------------------------------------------------------------------------------ compute spans


@contextmanager
def span(label: str, kind: str = "compute", **extra) -> Iterator[Event]:
    """Record the code inside the `with` block as a compute span ("F mb3", kind="forward") on the timeline."""
    event = Event(_rank(), kind, time.perf_counter(), label=label, extra=extra)
    _events.append(event)
    if event_hook is not None:
        event_hook(_events)
    pace.enter_compute(event)
    finished = False
    try:
        yield event
        finished = True
    finally:
        # GPU kernels run asynchronously: wait for them, or the span would end when they were queued. Only where
        # CUDA has started (is_available() would start the driver in every gloo rank of a GPU machine).
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if finished:
            pace.hold_compute(event)  # an emulated device: held to its modelled duration (parlab.core.pace)
        else:
            pace.leave_compute(event)
        event.end = time.perf_counter()
