"""What runs inside each forked rank: seed, set up torch.distributed, run the function, send back its result and
events, and publish the traced call it is in (for the hang diagnosis)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from parlab.core import comm


class _CallBoard:
    """Rank side of the hang diagnosis: publishes the traced call this rank is in, and its pending asynchronous
    calls, in its slot of memory shared with the rank server (which passes it on to the parent).

    Slot layout: 8-byte sequence number (odd while it is being written), 4-byte length, JSON text."""

    MAX_PENDING = 32  # asynchronous calls never waited for are forgotten beyond this

    def __init__(self, slot: memoryview, rank: int, world_size: int):
        self.slot, self.rank, self.world_size = slot, rank, world_size
        self.seq, self.call, self.pending = 0, None, {}
        # Calls are matched in order within a stream: a group's collectives, or one rank's sends to another. A
        # peer that has finished k calls of a stream is past our k-th call there, so ours will complete.
        self.last_index = 0
        self.open: dict[int, tuple[str | None, int]] = {}  # call index -> (stream, its number k in the stream)
        self.issued: dict[str | None, int] = {}  # stream -> calls made
        self.finished: dict[str, int] = {}  # stream -> calls done

    def _stream(self, event) -> str | None:
        if event.kind == "send":
            return f"{self.rank}>{event.peer}"
        if event.kind == "recv":
            return None if event.peer is None else f"{event.peer}>{self.rank}"  # None: from any rank
        members = event.group if event.group is not None else range(self.world_size)
        return ",".join(map(str, members))

    def hook(self, event, index: int, state: str) -> None:
        """comm.call_hook: the rank is "waiting" in traced call #index (or "waiting again" on a handle it has
        already waited for), has it "in flight", or is "done" with it."""
        new = index > self.last_index  # a new call, not a wait() on an asynchronous one issued before
        if new:
            self.last_index = index
            stream = self._stream(event)
            self.issued[stream] = self.issued.get(stream, 0) + 1
            self.open[index] = (stream, self.issued[stream])
            if len(self.open) > 64 * self.MAX_PENDING:  # asynchronous calls never waited for: forget the oldest
                self.open.pop(next(iter(self.open)))
        if state in ("waiting", "waiting again"):
            # how: "call" (in the call itself), "wait" (in wait() on an asynchronous call), "again" (in a second
            # wait() on a handle already waited for: it has completed, and gloo's wait() on it does not return)
            how = "again" if state == "waiting again" else "call" if new else "wait"
            self.call = {**self._as_dict(event, index), "how": how}
        else:
            self.call = None
            if state == "in flight":  # an asynchronous call: it may serve a peer's call until it is waited for
                self.pending[index] = self._as_dict(event, index)
                if len(self.pending) > self.MAX_PENDING:
                    self.pending.pop(next(iter(self.pending)))
            else:
                self.pending.pop(index, None)
                stream, _ = self.open.pop(index, (None, 0))
                if stream is not None:
                    self.finished[stream] = self.finished.get(stream, 0) + 1
        self.publish()

    def _as_dict(self, event, index: int) -> dict:
        stream, k = self.open.get(index, (None, 0))
        return {
            "i": index,
            "kind": event.kind,
            "bytes": event.bytes,
            "peer": event.peer,
            "group": None if event.group is None else list(event.group),
            "label": event.label,
            "stream": stream,
            "k": k,
            "since": time.monotonic(),
        }

    def publish(self, done: bool = False) -> None:
        state = {"call": self.call, "pending": list(self.pending.values()), "finished": self.finished, "done": done}
        data = json.dumps(state).encode()
        if len(data) > len(self.slot) - 12:  # too many pending calls to tell: the current one matters most
            data = json.dumps({**state, "pending": []}).encode()[: len(self.slot) - 12]
        self.seq += 1  # odd: the server skips the slot while it is being written
        self.slot[0:8] = self.seq.to_bytes(8, "little")
        self.slot[8:12] = len(data).to_bytes(4, "little")
        self.slot[12 : 12 + len(data)] = data
        self.seq += 1
        self.slot[0:8] = self.seq.to_bytes(8, "little")


def _seed_generators(seed: int) -> None:
    """Seed this rank's Python, NumPy and torch generators (forked ranks would otherwise all draw the same)."""
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")  # torch has imported it where it is installed
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _to_cpu(value, memo: dict | None = None):
    """Tensors go back to the parent on the CPU.

    memo: the containers met so far, by id, and what each became, so that a container that holds itself (a list
    appended to itself) comes back with its cycle, as pickle would send it, rather than recursing for ever. A plain
    list or dict is entered in the memo before its items are converted; a tuple (built from its items) is marked
    while it is, and met again inside itself it is left as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if not isinstance(value, (list, tuple, dict)):
        return value
    memo = {} if memo is None else memo
    if id(value) in memo:
        converted = memo[id(value)]
        return value if converted is _CONVERTING else converted
    if type(value) is list:
        out = memo[id(value)] = []
        out.extend(_to_cpu(v, memo) for v in value)
        return out
    if isinstance(value, dict):
        out = memo[id(value)] = {}
        out.update((k, _to_cpu(v, memo)) for k, v in value.items())
        return out
    memo[id(value)] = _CONVERTING
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        out = type(value)(*(_to_cpu(v, memo) for v in value))
    else:  # a tuple, or a subclass of list or tuple
        out = type(value)(_to_cpu(v, memo) for v in value)
    memo[id(value)] = out
    return out


_CONVERTING = object()  # in _to_cpu's memo: a tuple whose items are being converted


class _Unsendable(Exception):
    """The value a rank returned cannot be pickled."""


def _pack_result(rank: int, value: Any, events: list) -> bytes:
    """What the rank returned and its trace, pickled by cloudpickle (as the function came)."""
    try:
        value = _to_cpu(value)
        return cloudpickle.dumps((value, events))
    except RecursionError as exc:  # nested deeper than Python's recursion limit: no part of it is to blame
        raise _Unsendable(
            f"The value rank {rank} returned cannot be sent back to the parent: it is nested more than "
            f"{sys.getrecursionlimit()} levels deep (pickle's limit). Return flatter data."
        ) from exc
    except Exception as exc:
        path, part, error = _unsendable_part(value) or ("result", value, exc)
        kind = type(part).__qualname__
        if type(part).__module__ != "builtins":
            kind = type(part).__module__ + "." + kind
        raise _Unsendable(
            f"The value rank {rank} returned cannot be sent back to the parent: {path} is a {kind}, which cannot "
            f"be pickled ({type(error).__name__}: {error}). Return data: tensors, numbers, strings, containers "
            "of them, dataclasses."
        ) from exc


def _unsendable_part(value: Any, path: str = "result", depth: int = 0) -> tuple[str, Any, Exception] | None:
    """(path, part, error) for the innermost part of `value` that cannot be pickled, e.g. "result['lock']"."""
    try:
        cloudpickle.dumps(value)
        return None
    except Exception as exc:
        error = exc
    if depth < 12:
        for sub_path, part in _parts(value, path):
            found = _unsendable_part(part, sub_path, depth + 1)
            if found is not None:
                return found
    return path, value, error


def _parts(value: Any, path: str) -> list[tuple[str, Any]]:
    """The named parts of a container, a dataclass or an object, to look for the one that cannot be pickled."""
    if isinstance(value, dict):
        return [(f"{path}[{key!r}]", part) for key, part in value.items()]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return [(f"{path}.{name}", getattr(value, name)) for name in value._fields]
    if isinstance(value, (list, tuple)):
        return [(f"{path}[{i}]", part) for i, part in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [(f"an element of {path}", part) for part in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f"{path}.{field.name}", getattr(value, field.name)) for field in dataclasses.fields(value)]
    if not isinstance(value, type) and isinstance(getattr(value, "__dict__", None), dict):
        return [(f"{path}.{name}", part) for name, part in vars(value).items()]
    return []


def _prepare_spare(cuda_device: int | None = None) -> None:
    """A spare, while it waits for its job: run once what every rank runs first, so that the pages it writes are
    copied from the server now rather than during the launch (the job reseeds every generator).

    cuda_device: the GPU of the rank this spare will be (spares of an NCCL job are prepared as ranks 0, 1, ...):
    its CUDA context is made now, off the next launch's path. Safe here, and only here: the spare is a process of
    its own that forks nothing, while the rank server that forks it never touches CUDA (a process that has
    initialised CUDA must not fork processes that use it)."""
    _seed_generators(0)
    cloudpickle.loads(cloudpickle.dumps((_seed_generators, (), {})))
    if cuda_device is not None:
        _cuda_context(cuda_device)


def _cuda_context(index: int) -> torch.device:
    """Make this process's CUDA context on GPU `index` now and make that GPU current; returns the device.

    torch.cuda.set_device alone may leave the context for later (for GPU 0, the current one already, it does not
    even call cudaSetDevice): the first allocation on the device makes it, here rather than in the first
    collective, so that a launch's phases say what each costs."""
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)
    return device


def _init_process_group(job: dict, rank: int, phases: dict[str, float]) -> None:
    """torch.distributed for this rank, noting when each phase ends. Under NCCL: this rank's GPU (its CUDA
    context made first), and device_id given, so that the communicator is made now, eagerly, rather than inside
    the first collective (torch >= 2.3: "the communicator is immediately formed")."""
    kwargs = {}
    if job["backend"] == "nccl":
        kwargs["device_id"] = _cuda_context(rank)
        phases["cuda_context"] = time.perf_counter()
    dist.init_process_group(
        job["backend"],
        init_method=f"file://{job['rendezvous']}",
        rank=rank,
        world_size=job["world_size"],
        **kwargs,
    )
    phases["process_group"] = time.perf_counter()


def _rank_main(job: dict, rank: int, out: Connection, slot: memoryview, captured) -> None:
    """One rank, in the process the rank server forked for it: run fn, send back what it returned.

    (It lives here rather than in rankserver.py so that each rank runs the parlab code on disk.)"""
    phases = {"rank_start": time.perf_counter()}  # the launch's phases on this rank (perf_counter: one clock for all)
    pid = os.getpid()  # the rank's own process (rank code may fork: see below)
    # comm.progress() in rank code reports through the same pipe
    comm.progress_hook = lambda update: out.send_bytes(pickle.dumps({"progress": update}))
    board = _CallBoard(slot, rank, job["world_size"])
    comm.call_hook = board.hook
    if job.get("stream_events"):  # a live timeline in the parent: stream this rank's events as they happen
        from parlab.runtime.events import EventStream

        comm.event_hook = EventStream(lambda update: out.send_bytes(pickle.dumps({"progress": update})), rank)
    else:
        comm.event_hook = None
    _seed_generators(job["seed"] + rank)
    torch.set_default_dtype(job["default_dtype"])
    try:
        fn, args, kwargs = pickle.loads(job["fn"])
        _init_process_group(job, rank, phases)
        out.send_bytes(pickle.dumps({"progress": {"rank": rank, "started": True}}))
        comm.reset_trace()
        value = fn(*args, **kwargs)
        phases["fn_done"] = time.perf_counter()
        message = {"rank": rank, "ok": True, "payload": _pack_result(rank, value, comm.trace_events())}
    except _Unsendable as exc:  # the pickling error is the whole story: no traceback into parlab's code
        error = "".join(traceback.format_exception_only(exc.__cause__)) if exc.__cause__ else ""
        message = {"rank": rank, "ok": False, "reason": str(exc), "traceback": error}
    except BaseException:
        message = {"rank": rank, "ok": False, "traceback": traceback.format_exc()}
    if os.getpid() != pid:
        # A process the rank code forked (os.fork) that returned from it too: only the rank's own process speaks
        # for the rank. It leaves at once, without a word on the rank's pipe and without Python's exit handlers
        # (those are the rank's).
        os._exit(0 if message["ok"] else 1)
    message["stdout"], message["phases"] = captured.getvalue(), phases
    board.publish(done=True)
    out.send_bytes(pickle.dumps(message))
    if message["ok"]:
        _wait_to_be_stopped()
    out.close()


def _wait_to_be_stopped() -> None:
    """Leave together, without a barrier: a rank that tore down its connections early could break a peer's last
    collective, so a rank that has returned waits here until the rank server has every rank's result and kills
    them all at once (it always does; and the rank dies with the server). No `destroy_process_group`: the process
    ends, and with it everything the group held; that saves a barrier and ~30 ms per launch on 2 cores."""
    while True:
        time.sleep(3600)
