"""Rank side: record every call the student's code makes into torch.distributed, at the lowest Python level.

`parlab.core.comm` traces the calls that go through it; a student may also call `torch.distributed` directly, or a
process group's methods. All of these end in a method of `torch._C._distributed_c10d.ProcessGroup` (`allreduce`,
`send`, ...), so that is where the probe listens, while the student's function runs:

    with probe.recording() as calls:
        phase(chunks)
    calls  # [{"op": "send", "peer": 1, "bytes": 2000, "data": <the tensor sent>}, {"op": "recv", ...}, ...]

Each record is plain data (str, int, tensor), so it travels to the grader as such.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

P2P = ("send", "recv", "recv_anysource")


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in a call's argument: a tensor, or (nested) lists and tuples of them (also used by
    parlab/twins/record.py and the lab 05 recorder)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _methods(cls) -> list[str]:
    skip = {"rank", "size", "name", "group_name", "group_desc", "bound_device_id", "boxed", "unbox", "abort"}
    skip |= {"shutdown", "set_timeout", "get_group_store", "split_group", "merge_remote_group"}
    skip |= {"use_pg_for_symm_mem_rendezvous"}
    return [m for m in dir(cls) if not m.startswith("_") and m not in skip and callable(getattr(cls, m))]


@contextmanager
def recording(keep_sent_data: bool = True, with_groups: bool = False) -> Iterator[list[dict]]:
    """Record the process-group calls made inside the `with` block (this process only).

    with_groups: also record "group", the sorted global ranks of the process group each call ran on, and give a
    send's or receive's "peer" as the partner's global rank (by default it is its rank in the call's group)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup

    calls: list[dict] = []
    originals = {name: getattr(ProcessGroup, name) for name in _methods(ProcessGroup)}
    originals = {name: fn for name, fn in originals.items() if not isinstance(fn, type)}

    def wrap(name, original):
        def recorded(self, *args, **kwargs):
            tensors = _tensors(args[0]) if args else []
            record = {"op": name, "bytes": sum(t.numel() * t.element_size() for t in tensors), "peer": -1}
            if name in P2P and len(args) > 1 and isinstance(args[1], int):
                record["peer"] = args[1]  # the group rank (the default group's is the global rank)
            if with_groups:
                try:
                    group = sorted(dist.get_process_group_ranks(self))
                except (RuntimeError, ValueError, KeyError):
                    group = []  # a group torch does not know: it can match no axis
                record["group"] = group
                if record["peer"] != -1:
                    record["peer"] = group[record["peer"]] if 0 <= record["peer"] < len(group) else -1
            if name == "send" and keep_sent_data and tensors:
                record["data"] = tensors[0].detach().cpu().clone().flatten()
            calls.append(record)
            return original(self, *args, **kwargs)

        return recorded

    with wrapped(ProcessGroup, originals, wrap):
        yield calls


@contextmanager
def wrapped(cls, originals: dict, wrap) -> Iterator[None]:
    """Replace each method `name` of `cls` (in `originals`) by `wrap(name, original)` inside the block.

    What is put back is the class's own attribute (for a pybind11 class, an instancemethod), not what getattr
    returned (a plain builtin that would no longer receive `self`: every later call would fail with a TypeError)."""
    own = {name: inspect.getattr_static(cls, name) for name in originals}
    for name, original in originals.items():
        setattr(cls, name, wrap(name, original))
    try:
        yield
    finally:
        for name, attribute in own.items():
            setattr(cls, name, attribute)


def total_bytes(calls, op: str) -> int:
    """Bytes handed to torch.distributed by the calls of one kind ("allreduce", "send", ...)."""
    return sum(int(c["bytes"]) for c in calls if c["op"] == op)


def library_collectives(calls) -> list[str]:
    """The collectives among the calls (everything but point-to-point send and recv), in order."""
    return [c["op"] for c in calls if c["op"] not in P2P]
