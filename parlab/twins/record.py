"""The twin's traffic, counted like parlab's: every collective PyTorch issues, as a parlab `Event`.

parlab's schemes call `parlab.core.comm`, which records each call. PyTorch's own implementations (DDP, FSDP2, DTensor,
pipelining) call torch.distributed from deep inside, and DTensor and FSDP2 even skip the Python layer (functional
collectives go straight to C++). Every one of them still passes through PyTorch's dispatcher as an operator
(`c10d.allreduce_`, `_c10d_functional.all_gather_into_tensor`, `c10d.send`, ...), so a dispatch mode sees them all:

    with recording() as events:           # this rank only
        loss.backward()                   # DDP's bucket all-reduces, FSDP2's reduce-scatters, ...
    events[0].kind, events[0].bytes       # "all_reduce", 4096

Bytes follow parlab.core.comm's convention (the payload this rank hands over): all_gather counts this rank's input,
reduce_scatter the whole input, send/recv the tensor. The events carry no timing worth drawing (start = end).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from parlab.core.probe import _tensors  # every tensor in a call's arguments
from parlab.core.trace import Event, Trace

# Operator name (without namespace or trailing underscore) -> parlab's kind, for both c10d and functional ops.
KINDS = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
    "recv_any_source": "recv",
    "barrier": "barrier",
}
# c10d ops whose first argument is the output: the payload is the second one.
OUTPUT_FIRST = {"_allgather_base", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced"}
OUTPUT_FIRST |= {"_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced", "alltoall"}
OUTPUT_FIRST |= {"alltoall_base"}


_paused = 0  # > 0 inside `unrecorded()`


@contextmanager
def unrecorded() -> Iterator[None]:
    """Leave out the calls made inside (set-up, and the gathers that only serve the comparison)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def op_kind(func) -> tuple[str, str] | None:
    """(kind, bare op name) of a communication operator, or None for anything else."""
    namespace = func.namespace
    if namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
        return None
    name = func.__name__.split(".")[0].rstrip("_")
    name = "_" + name.lstrip("_") if func.__name__.startswith("_") else name
    kind = KINDS.get(name)
    return (kind, name) if kind else None


class _Recorder(TorchDispatchMode):
    def __init__(self, events: list[Event]):
        super().__init__()
        self.events, self.rank = events, dist.get_rank() if dist.is_initialized() else 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        found = op_kind(func)
        if found is not None and not _paused:
            kind, name = found
            payload = args[1] if name in OUTPUT_FIRST and len(args) > 1 else (args[0] if args else ())
            now = time.perf_counter()
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(payload))
            self.events.append(Event(self.rank, kind, now, now, nbytes, label=f"torch {name}"))
        return func(*args, **(kwargs or {}))


@contextmanager
def recording() -> Iterator[list[Event]]:
    """The communication operators this rank runs inside the block, as parlab Events (rank, kind, bytes)."""
    events: list[Event] = []
    with _Recorder(events):
        yield events


def bytes_per_rank(events_per_rank: list[list[Event]]) -> dict[str, list[int]]:
    """{kind: [payload bytes of rank 0, 1, ...]}, as `Trace.bytes_per_rank` gives for parlab's own run."""
    flat = [e for events in events_per_rank for e in events]
    return Trace(flat, len(events_per_rank)).bytes_per_rank()
