"""Run one function on N ranks, from a notebook cell, a script or a test.

    results = parlab.launch(fn, 4, x, steps=3)   # fn(x, steps=3) runs on ranks 0..3, torch.distributed ready
    results[2]                                    # what rank 2 returned (tensors come back as CPU tensors)
    results.trace                                 # every traced collective and compute span, from all ranks

Each rank is a real process with its own `torch.distributed` process group (gloo on CPU, NCCL when there is one
GPU per rank). The processes are forked by a rank server that imported torch once (see `_rankserver.py`), so a
warm launch costs a fraction of a second. `fn` travels by value (cloudpickle), and so do the values the ranks
return: a function or a dataclass written in a notebook cell works both ways.

The rank server starts in the background as soon as parlab is imported in a Jupyter kernel, so that the first
launch of a lesson is as fast as the others; elsewhere (scripts, tests) it starts at the first launch, or at
`warm_up()`, or at import when the environment variable PARLAB_WARM=1 (PARLAB_WARM=0: never at import).

While the ranks run, each one publishes the traced call it is in (`parlab.comm`); `launch` stops ranks that wait in
calls that can never match (e.g. rank 0 in all_reduce, rank 1 in broadcast) after `MISMATCH_SECONDS` and raises
`CollectiveMismatch` naming each rank's call.

Beyond one machine, the same rank code runs under `torchrun` instead: `parlab.init_from_env()` sets up the process
group from torchrun's environment (see `python -m parlab run --help`). parlab never launches multi-node jobs itself.
"""

from __future__ import annotations

import atexit
import dataclasses
import glob
import itertools
import json
import math
import os
import pickle
import queue
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from html import escape as html_escape
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from parlab import comm
from parlab.trace import Trace

DEFAULT_TIMEOUT = 120.0  # seconds; long enough for any lesson at world size 8 on 2 CPU cores
SERVER_START_TIMEOUT = 300.0  # seconds for the rank server to import torch (slow disks, busy machines)
MISMATCH_SECONDS = 2.0  # how long ranks wait in calls that cannot match before launch stops them
CANCEL_WAIT = 10.0  # seconds for the server to stop a job's ranks; longer means it is stuck: it is replaced
RENDEZVOUS_PREFIX = "parlab-rendezvous-"  # rendezvous files in the temp folder: this + "<server pid>-<job id>"
SLOT_BYTES = 4096  # shared memory per rank for the call it is in (JSON; a group of ~500 ranks still fits)


# ------------------------------------------------------------------------------------------------------ errors


class RankError(RuntimeError):
    """A rank raised (or died). `rank` is the first rank that failed; `remote_traceback` is its traceback.

    `reason`, when set, says what went wrong outside the rank's own code (e.g. a return value that cannot be
    sent back to the parent, naming the part of the value at fault)."""

    def __init__(self, rank: int, remote_traceback: str, stdout: str = "", reason: str = ""):
        self.rank, self.remote_traceback, self.stdout, self.reason = rank, remote_traceback, stdout, reason
        text = f"rank {rank} failed; the other ranks were stopped.\n"
        if reason:
            text += reason.rstrip() + "\n"
        text += f"\n--- traceback on rank {rank} ---\n" + remote_traceback.rstrip()
        if stdout.strip():
            text += f"\n--- rank {rank} printed ---\n{stdout.rstrip()}"
        super().__init__(text)


class LaunchTimeout(TimeoutError):
    """Some ranks had not finished when the timeout expired (a hang: e.g. mismatched collectives).

    `unfinished`: those ranks; `calls`: what each rank was doing, in words ("in all_reduce #3 (8 bytes, world)
    for 1.9 s", "computing (not in a traced call)", "returned")."""

    def __init__(self, timeout: float, unfinished: list[int], world_size: int, calls: dict[int, str] | None = None):
        self.unfinished, self.calls = unfinished, calls or {}
        finished = sorted(set(range(world_size)) - set(unfinished))
        text = (
            f"ranks {unfinished} had not finished after {timeout:g} s and were stopped "
            f"(finished: {finished or 'none'}). A hang like this usually means the ranks called "
            "different collectives, or a send without its matching recv."
        )
        if self.calls:
            text += "\nWhat each unfinished rank was doing:" + "".join(
                f"\n  rank {rank}: {self.calls[rank]}" for rank in unfinished if rank in self.calls
            )
        super().__init__(text)


class CollectiveMismatch(LaunchTimeout):
    """Ranks waited in communication calls that can never match, so `launch` stopped them early.

    A subclass of `LaunchTimeout` because it is a hang, diagnosed before the timeout: `except LaunchTimeout`
    catches both. `stuck`: the ranks whose calls can never complete; `calls`: every rank's state, in words;
    `entered`: when (time.monotonic()) the last of the stuck ranks entered its call.
    """

    def __init__(self, what: str, stuck: list[int], waited: float, entered: float, calls: dict[int, str]):
        self.stuck, self.entered, self.calls = stuck, entered, calls
        self.unfinished = sorted(r for r, state in calls.items() if state != "returned")
        returned = sorted(r for r, state in calls.items() if state == "returned")
        parts = [f"rank {stuck[0]} is {calls[stuck[0]]}"] + [f"rank {r} {calls[r]}" for r in stuck[1:]]
        parts += [f"rank {r} had returned" for r in returned]
        text = f"{what}: " + ", ".join(parts) + "."
        text += (
            f"\nThese calls can never match (the ranks waited {waited:.1f} s and were stopped): every rank of a "
            "group must make the same collective calls in the same order (same operation, size, group and root), "
            "and each send needs a matching recv."
        )
        others = [r for r in self.unfinished if r not in stuck]
        if others:
            text += "\nThe other ranks:" + "".join(f"\n  rank {r}: {calls[r]}" for r in others)
        TimeoutError.__init__(self, text)


class Results(list):
    """What each rank returned, in rank order, plus the merged `trace` and each rank's printed `stdout`.

    `seed`: the launch's seed (rank r's generators were seeded with seed + r; None when not launched)."""

    def __init__(self, values: list, trace: Trace, stdout: list[str], seconds: float, seed: int | None = None):
        super().__init__(values)
        self.trace, self.stdout, self.seconds, self.seed = trace, stdout, seconds, seed


# ---------------------------------------------------------------------------------------------- the rank server


class _RankServer:
    """Handle on the rank-server process (one per parent process).

    Only two threads of this process touch the socket: one sends what `outbox` holds, one reads every message
    into `inbox`. The launching thread only puts and gets whole messages, so a KeyboardInterrupt, which Python
    raises in the main thread only, can never leave half a message in the socket."""

    def __init__(self, warm: bool = False):
        self.warm = warm  # started by warm_up(): an interrupted launch leaves it running
        ours, theirs = socket.socketpair()
        script = Path(__file__).with_name("_rankserver.py")
        self.process = subprocess.Popen(
            [sys.executable, str(script), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.started = time.monotonic()
        self.socket = ours
        self.conn = Connection(os.dup(ours.fileno()))
        self.ready = threading.Event()  # set when the server has imported torch, or has died
        self.tmp = tempfile.gettempdir()
        self.dead = False
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # SimpleQueue: put and get are atomic under Ctrl-C
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._write, name="parlab-server-writer", daemon=True),
            threading.Thread(target=self._read, name="parlab-server-reader", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _write(self) -> None:
        while (data := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the server is gone; the reader sees it too
                return

    def _read(self) -> None:
        try:
            while True:
                message = pickle.loads(self.conn.recv_bytes())
                if "ready" in message:
                    self.tmp = message["tmp"]  # where its rendezvous files go (the server's TMPDIR)
                    self.ready.set()
                else:
                    self.inbox.put(message)
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        finally:
            self.dead = True
            self.ready.set()
            self.inbox.put(None)  # wakes a launch waiting for a message

    def send(self, message: dict) -> None:
        self.outbox.put(pickle.dumps(message))

    def next_message(self, job_id: int, timeout: float) -> dict | None:
        """The next message about job `job_id` within `timeout` seconds (None if none came, or the server died)."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                message = self.inbox.get(timeout=remaining)
            except queue.Empty:
                return None
            if message is None:  # the server died
                self.inbox.put(None)  # for the next caller too
                return None
            if message.get("job_id") == job_id:
                return message
            # else: left over from an interrupted launch
        return None

    def wait_ready(self) -> None:
        """Wait until the server has imported torch (this start-up is not counted in a launch's timeout)."""
        while not self.ready.wait(0.25):
            if time.monotonic() - self.started > SERVER_START_TIMEOUT:
                raise RuntimeError(f"the parlab rank server did not start within {SERVER_START_TIMEOUT:g} s")
        if self.dead:
            raise RuntimeError(f"the parlab rank server exited at start-up (exit code {self.process.wait()})")

    def cancel(self, job_id: int) -> dict | None:
        """Stop the job's ranks and return its report (None if it was not running). A server that does not
        answer within CANCEL_WAIT seconds is stuck: it is shut down (a new one starts at the next launch)."""
        self.send({"cancel": job_id})
        deadline = time.monotonic() + CANCEL_WAIT
        while (remaining := deadline - time.monotonic()) > 0:
            message = self.next_message(job_id, remaining)
            if message is None:
                break
            if "report" in message:
                return message["report"]
        _retire(self)
        return None

    def alive(self) -> bool:
        return not self.dead and self.process.poll() is None

    def close(self) -> None:
        if not self.ready.is_set():  # still importing torch, with no rank yet: nothing to stop gently
            self.process.kill()
        try:
            self.socket.shutdown(socket.SHUT_RDWR)  # the server reads EOF and exits; its ranks die with it
        except OSError:
            pass
        interrupted = None
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
        except KeyboardInterrupt as exc:  # never leave the server behind, even on a second Ctrl-C
            self.process.kill()
            interrupted = exc
        self.process.wait()
        self.outbox.put(None)
        for thread in self.threads:
            thread.join(timeout=5)
        self.conn.close()
        self.socket.close()
        # A killed server cannot remove its rendezvous files itself.
        for path in glob.glob(os.path.join(self.tmp, f"{RENDEZVOUS_PREFIX}{self.process.pid}-*")):
            try:
                os.remove(path)
            except OSError:
                pass
        if interrupted is not None:
            raise interrupted


_server: _RankServer | None = None
_server_lock = threading.Lock()  # guards _server
_lock = threading.Lock()  # one launch at a time per parent process
_job_ids = itertools.count()  # a message names its job: one left over from an interrupted launch is ignored


def _forget_server_in_child() -> None:
    """A process forked from this one (a DataLoader worker, multiprocessing) must not use, nor at its exit shut
    down, this process's rank server: it shares the socket. It starts its own if it launches."""
    global _server, _server_lock, _lock
    _server, _server_lock, _lock = None, threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_forget_server_in_child)


def _get_server(warm: bool = False) -> _RankServer:
    """The running rank server, started now if there is none (this returns at once: it may not be ready yet)."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            if _server is not None:
                _server.close()
            _server = _RankServer(warm=warm)
        return _server


def warm_up(wait: bool = False) -> None:
    """Start the rank server in the background now, so that the first launch does not wait for it.

    parlab calls this at import in a Jupyter kernel, or anywhere when PARLAB_WARM=1. `wait`: block until the
    server is ready. It returns at once if a server is already running."""
    server = _get_server(warm=True)
    server.warm = True  # asked for: a launch interrupted while it starts leaves it running
    if wait:
        server.wait_ready()


def shutdown() -> None:
    """Stop the rank server (it restarts at the next launch). Called automatically at exit."""
    server = _server
    if server is not None:
        _retire(server)


def _retire(server: _RankServer) -> None:
    """Stop this server and forget it (a dead or stuck one, or at shutdown)."""
    global _server
    with _server_lock:
        if _server is server:
            _server = None
    server.close()


atexit.register(shutdown)


def rank_server_pid() -> int | None:
    """The rank server's process id (tests use it to check that no rank outlives its launch)."""
    server = _server
    return server.process.pid if server is not None and server.alive() else None


# --------------------------------------------------------------------------------------------------- launching


def default_backend(world_size: int) -> str:
    """NCCL when there is one GPU per rank, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def check_launch_args(fn: Any, world_size: Any, backend: str | None, timeout: float, threads: Any = None) -> str:
    """Reject bad arguments before any process starts; return the backend to use."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be None (share the cores out) or an int >= 1, got {threads!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    backend = backend or default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > gpus:
            raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPUs")
    return backend


def available_cpus() -> int:
    """The CPU cores this process may use: its affinity mask, capped by a container's CPU quota.

    On Binder os.cpu_count() reports the host's cores while the pod gets 1-2: ranks would oversubscribe."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return cpus if quota is None else min(cpus, quota)


def _cgroup_cpu_quota() -> int | None:
    """Whole CPUs allowed by the container's CPU quota (cgroup v2, else v1), or None where there is none."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()  # "max 100000" or "150000 100000"
    except (OSError, ValueError):
        try:
            quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text().strip()  # "-1" when unlimited
            period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return max(1, int(quota) // int(period))


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    threads: int | None = None,
    echo: bool = True,
    **kwargs: Any,
) -> Results:
    """Run `fn(*args, **kwargs)` on `world_size` ranks and return what each rank returned, in rank order.

    Inside `fn`, `torch.distributed` is initialised: `dist.get_rank()`, `dist.get_world_size()` and every
    collective work, and `parlab.comm` records what the rank communicates.

    backend: "gloo" (CPU) or "nccl" (one GPU per rank); default: NCCL when there are enough GPUs, else gloo.
    timeout: seconds before unfinished ranks are stopped and `LaunchTimeout` names them and what they were doing.
    threads: torch threads per rank (default: the CPU cores shared out among the ranks, at least 1).
    echo: print what the ranks printed, grouped by rank in rank order, once they are done.

    What each rank gets from this process at every launch: `fn` and its arguments (by value, cloudpickle), all
    environment variables as they are now (`os.environ`; those read only when torch is imported, such as
    OMP_NUM_THREADS, take effect when the rank server starts), torch's default dtype, `sys.path` and the current
    folder. What comes back: each returned value, by value (cloudpickle: classes defined in a notebook cell work;
    tensors come back on the CPU).

    Random numbers: rank r's Python `random`, NumPy and torch generators are seeded with `seed + r`, where `seed`
    is drawn afresh for each launch (it is `results.seed`): ranks draw different numbers, and so do launches.
    For numbers that repeat, seed inside `fn` (e.g. `torch.manual_seed(dist.get_rank())`) or use a
    `torch.Generator`.

    Raises `RankError` (the failing rank and its traceback) if any rank raises, or returns a value that cannot
    be sent back (the error names the part of the value at fault); the other ranks are stopped.
    Raises `CollectiveMismatch` (a `LaunchTimeout`) when ranks wait `MISMATCH_SECONDS` in traced calls that can
    never match each other, naming each rank's call; `LaunchTimeout` at the timeout otherwise.
    Ctrl-C stops the ranks; the next launch works as usual.
    """
    backend = check_launch_args(fn, world_size, backend, timeout, threads)
    threads = threads or max(1, available_cpus() // world_size)
    seed = int.from_bytes(os.urandom(4), "little")
    job = {
        "id": next(_job_ids),
        "fn": cloudpickle.dumps((fn, args, kwargs)),
        "world_size": world_size,
        "backend": backend,
        "threads": threads,
        "sys_path": list(sys.path),
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "default_dtype": torch.get_default_dtype(),
        "seed": seed,
        "slot_bytes": SLOT_BYTES,
    }
    job_id, request = job["id"], pickle.dumps({"job": job})
    del job  # the pickled request is what travels: no second copy of a large closure while the ranks run
    with _lock:
        server = _get_server()
        try:
            server.wait_ready()
        except KeyboardInterrupt:
            if not server.warm:  # a launch interrupted while its server starts leaves no server behind
                _retire(server)
            raise
        except RuntimeError:
            _retire(server)
            raise
        started = time.perf_counter()
        server.outbox.put(request)
        del request
        report, stopped, calls = _wait_for_report(server, job_id, timeout, world_size)
        seconds = time.perf_counter() - started
    return _results_from(report, stopped, calls, world_size, timeout, seconds, echo, seed)


def _wait_for_report(server: _RankServer, job_id: int, timeout: float, world_size: int):
    """Wait for the job's report, showing progress and watching for hangs; on a timeout, a mismatch or Ctrl-C,
    stop the ranks first. Returns (report, why the ranks were stopped: None, "timeout" or a CollectiveMismatch,
    each rank's last known state in words)."""
    progress, watch = _ProgressLine(world_size), _HangWatch(world_size)
    deadline = time.monotonic() + timeout
    try:
        stopped: str | CollectiveMismatch = "timeout"
        while (remaining := deadline - time.monotonic()) > 0:
            message = server.next_message(job_id, min(remaining, 0.25))
            if message is None and not server.alive():
                _retire(server)
                raise RuntimeError("the parlab rank server died; it will restart at the next launch")
            if message is not None:
                if "report" in message:
                    progress.close()
                    return message["report"], None, watch.describe()
                if "progress" in message:
                    progress.update(message["progress"])
                elif "calls" in message:
                    watch.update(message["calls"], message["at"])
            mismatch = watch.mismatch()
            if mismatch is not None:
                stopped = mismatch
                break
            progress.waiting = watch.longest_wait()
            progress.show()
        progress.close()
        calls = watch.describe()
        return server.cancel(job_id), stopped, calls
    except BaseException:  # Ctrl-C, or a bug of the watch itself: the ranks must not outlive the launch
        progress.close()
        server.cancel(job_id)  # the ranks are gone once it returns (a second Ctrl-C leaves at once; they still go)
        raise


def _results_from(report, stopped, calls, world_size, timeout, seconds, echo, seed) -> Results:
    if report is None:  # the server did not answer and was replaced: nothing is known of the ranks
        report = {"messages": {}, "first_failure": None, "exit_codes": {}}
    messages = report["messages"]
    stdout = [messages.get(r, {}).get("stdout", "") for r in range(world_size)]
    failed = report["first_failure"]
    if stopped is not None and failed is None:
        if isinstance(stopped, CollectiveMismatch):
            raise stopped
        unfinished = [r for r in range(world_size) if not messages.get(r, {}).get("ok")]
        raise LaunchTimeout(timeout, unfinished, world_size, calls)
    if failed is not None:
        message = messages.get(failed)
        if message is None:  # the process died without a word (killed, an abort in C++, segfault, os._exit)
            raise _died(failed, report, calls)
        # Its peer may have aborted on a mismatch first, and this rank only lost the connection: say so too.
        reason = "\n".join(r for r in (message.get("reason", ""), _mismatch(report, calls)) if r)
        raise RankError(failed, message["traceback"], message.get("stdout", ""), reason)
    values, events = [], []
    for rank in range(world_size):
        try:
            value, rank_events = pickle.loads(messages[rank]["payload"])
        except Exception:
            reason = f"The value rank {rank} returned could not be rebuilt in this process."
            raise RankError(rank, traceback.format_exc(), stdout[rank], reason) from None
        values.append(value)
        events += rank_events
    if echo:
        for rank, text in enumerate(stdout):
            for line in text.splitlines():
                print(f"[rank {rank}] {line}")
    return Results(values, Trace(events, world_size), stdout, seconds, seed)


# gloo's words when the ranks of one collective disagree on its size ("Received data size doesn't match expected
# size"; "... size mismatch"): it aborts the process from C++, so they reach only the rank's own stderr.
_GLOO_MISMATCH = re.compile(r"(doesn't match expected size|size mismatch|collective mismatch|op mismatch)", re.I)


def _died(rank: int, report: dict, calls: dict[int, str]) -> RankError:
    """The error for a rank that exited without a message: its exit code, the last lines it wrote to its own
    stderr (the rank server captured them), and a collective mismatch if gloo reported one."""
    code = report["exit_codes"].get(rank)
    text = f"the process exited with code {code} before returning a result"
    own = [line for line in report.get("stderr_tails", {}).get(rank, "").splitlines() if line.strip()][-8:]
    if own:
        text += "\n--- the last lines it wrote to its stderr ---\n" + "\n".join(own)
    return RankError(rank, text, "", _mismatch(report, calls))


def _mismatch(report: dict, calls: dict[int, str]) -> str:
    """When gloo said on some rank's stderr that the ranks' calls disagree: a collective mismatch, named with
    gloo's words and what each rank was doing (its traced call); else ''."""
    tails = report.get("stderr_tails", {})
    said = [(r, line.strip()) for r in sorted(tails) for line in tails[r].splitlines() if _GLOO_MISMATCH.search(line)]
    if not said:
        return ""
    where, line = said[0]
    reason = (
        f"Collective mismatch: gloo on rank {where} said: {line[:300]}\n"
        "The ranks of a group called one collective with different sizes or kinds (every rank must make the "
        "same calls in the same order: same operation, size, dtype, group and root)."
    )
    known = {r: state for r, state in sorted(calls.items()) if state and not state.startswith("computing")}
    if known:
        reason += "\nWhat each rank was doing:" + "".join(f"\n  rank {r}: {state}" for r, state in known.items())
    return reason


# ---------------------------------------------------------------------------------------------- hang diagnosis
#
# Each rank publishes its state (see _CallBoard below) as a dict:
#     {"call": the traced call it waits in, or None while it computes,
#      "pending": its asynchronous calls not yet waited for, "done": True once it has returned,
#      "finished": {stream: how many calls of that stream it has finished}}
# where a call is {"i": its index among the rank's traced calls (1-based), "kind", "bytes", "peer", "group",
# "label", "stream" and "k": it is the k-th call of its stream (a group's collectives: "0,1,2"; the sends from
# rank 0 to rank 1: "0>1"), "since": time.monotonic() when the rank entered it}.

P2P = ("send", "recv")


def _members(call: dict, world_size: int) -> tuple[int, ...]:
    return tuple(call["group"]) if call["group"] is not None else tuple(range(world_size))


def _matches(rank: int, call: dict, other_rank: int, other: dict, world_size: int) -> bool:
    """Could `call` on `rank` and `other` on `other_rank` be two halves of one operation?"""
    if call["kind"] in P2P or other["kind"] in P2P:
        if {call["kind"], other["kind"]} != set(P2P):
            return False
        if call["kind"] == "send":
            src, send, dst, recv = rank, call, other_rank, other
        else:
            src, send, dst, recv = other_rank, other, rank, call
        return send["peer"] == dst and recv["peer"] in (src, None) and send["bytes"] == recv["bytes"]
    if (call["kind"], call["peer"]) != (other["kind"], other["peer"]):  # peer: broadcast's src, reduce's dst
        return False
    if _members(call, world_size) != _members(other, world_size):
        return False
    return call["kind"] == "all_to_all" or call["bytes"] == other["bytes"]  # all_to_all chunks may be uneven


def _partners(rank: int, call: dict, world_size: int) -> list[int]:
    """The ranks that `call` on `rank` waits for."""
    if call["kind"] in P2P:
        return [] if call["peer"] is None else [call["peer"]]  # recv from any rank: cannot tell
    return [r for r in _members(call, world_size) if r != rank and 0 <= r < world_size]


def _stuck_ranks(states: list[dict | None], world_size: int) -> list[int]:
    """The ranks waiting in calls that can never complete, from each rank's published state.

    A rank's call may complete if every rank it waits for is computing (it may still come), or is past the
    matching call, or waits in (or has pending) a matching call, or waits in another call that may itself
    complete. Start with every waiting rank
    and drop those whose call may complete until nothing changes: the ranks left wait for each other, or for
    ranks that have returned, in calls that do not match: a deadlock.
    """
    stuck = {r for r, state in enumerate(states) if state and state.get("call")}
    changed = True
    while changed:
        changed = False
        for rank in sorted(stuck):
            call = states[rank]["call"]
            partners = _partners(rank, call, world_size)
            if any(not 0 <= p < world_size for p in partners):
                continue  # a send to (or recv from) a rank that does not exist can never complete
            if all(_may_serve(p, states[p], rank, call, stuck, world_size) for p in partners):
                stuck.discard(rank)
                changed = True
    return sorted(stuck)


def _may_serve(partner: int, state: dict | None, rank: int, call: dict, stuck: set, world_size: int) -> bool:
    if state is None or not state.get("done") and state.get("call") is None:
        return True  # computing: it may still make the matching call
    if call.get("stream") is not None and state.get("finished", {}).get(call["stream"], 0) >= call["k"]:
        return True  # it is past the matching call (calls match in order): this one will complete
    if state.get("done"):
        return False
    offers = [state["call"], *state.get("pending", [])]
    if any(_matches(rank, call, partner, other, world_size) for other in offers):
        return True
    return partner not in stuck  # in another call that may complete, after which it may come


def _describe_call(call: dict, world_size: int) -> str:
    """ "all_reduce #3 (4 bytes, world)", "send #2 (12 bytes to rank 1)", "broadcast #1 (8 bytes, src=1, world)"."""
    kind, parts = call["kind"], []
    if kind == "send":
        parts.append(f"{call['bytes']} bytes to rank {call['peer']}")
    elif kind == "recv":
        parts.append(f"{call['bytes']} bytes from " + ("any rank" if call["peer"] is None else f"rank {call['peer']}"))
    else:
        if kind != "barrier":
            parts.append(f"{call['bytes']} bytes")
        if kind in ("broadcast", "reduce"):
            parts.append(f"{'src' if kind == 'broadcast' else 'dst'}={call['peer']}")
        members = _members(call, world_size)
        parts.append("world" if members == tuple(range(world_size)) else f"group {list(members)}")
    if call.get("label"):
        parts.append(repr(call["label"]))
    return f"{kind} #{call['i']} ({', '.join(parts)})"


class _HangWatch:
    """The parent's view of each rank's published state, and the diagnosis of calls that can never match."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.states: list[dict | None] = [None] * world_size
        self.seen_at = 0.0  # time.monotonic() when the server read the states

    def update(self, raw: list[bytes | None], at: float) -> None:
        self.seen_at = at
        for rank, data in enumerate(raw):
            if data:  # b"": nothing published yet; None: being written, keep the last state
                try:
                    self.states[rank] = json.loads(data)
                except ValueError:
                    pass

    def mismatch(self) -> CollectiveMismatch | None:
        """The error to raise if some ranks have waited MISMATCH_SECONDS in calls that can never match."""
        stuck = _stuck_ranks(self.states, self.world_size)
        if not stuck:
            return None
        entered = max(self.states[r]["call"]["since"] for r in stuck)
        if self.seen_at - entered < MISMATCH_SECONDS:  # not yet seen still there MISMATCH_SECONDS after
            return None
        waited = time.monotonic() - entered
        kinds = {self.states[r]["call"]["kind"] for r in stuck}
        what = "send/recv mismatch" if kinds <= set(P2P) else "collective mismatch"
        if kinds == {"send"} and len(stuck) > 1:  # a cycle of blocking sends: nobody is there to receive
            what = "deadlock: each of these ranks waits in a blocking send and none is receiving"
        calls = self.describe(with_time=False)
        return CollectiveMismatch(what, stuck, waited, entered, calls)

    def longest_wait(self) -> str:
        """ "rank 1 waits in all_reduce #3 (8 bytes, world) for 12 s" for the rank waiting longest, if over 2 s."""
        waiting = [
            (state["call"]["since"], rank) for rank, state in enumerate(self.states) if state and state.get("call")
        ]
        if not waiting or time.monotonic() - min(waiting)[0] < MISMATCH_SECONDS:
            return ""
        since, rank = min(waiting)
        call = _describe_call(self.states[rank]["call"], self.world_size)
        return f"rank {rank} waits in {call} for {time.monotonic() - since:.0f} s"

    def describe(self, with_time: bool = True) -> dict[int, str]:
        """Each rank's state in words: "in all_reduce #3 (8 bytes, world) for 1.9 s", "returned", ..."""
        now, words = time.monotonic(), {}
        for rank, state in enumerate(self.states):
            if state is None:
                words[rank] = "computing (no traced call yet)"
            elif state.get("done"):
                words[rank] = "returned"
            elif state.get("call") is None:
                words[rank] = "computing (not in a traced call)"
            else:
                call = state["call"]
                words[rank] = "in " + _describe_call(call, self.world_size)
                if with_time:
                    words[rank] += f" for {now - call['since']:.1f} s"
        return words


# --------------------------------------------------------------------------------------------- in each rank


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
        """comm.call_hook: the rank is "waiting" in traced call #index, has it "in flight", or is "done" with it."""
        if index > self.last_index:  # a new call (not a second wait() on an old one)
            self.last_index = index
            stream = self._stream(event)
            self.issued[stream] = self.issued.get(stream, 0) + 1
            self.open[index] = (stream, self.issued[stream])
            if len(self.open) > 64 * self.MAX_PENDING:  # asynchronous calls never waited for: forget the oldest
                self.open.pop(next(iter(self.open)))
        if state == "waiting":
            self.call = self._as_dict(event, index)
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


def _to_cpu(value):
    """Tensors go back to the parent on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


class _Unsendable(Exception):
    """The value a rank returned cannot be pickled."""


def _pack_result(rank: int, value: Any, events: list) -> bytes:
    """What the rank returned and its trace, pickled by cloudpickle (as the function came)."""
    value = _to_cpu(value)
    try:
        return cloudpickle.dumps((value, events))
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


def _rank_main(job: dict, rank: int, out: Connection, slot: memoryview, captured) -> None:
    """One rank, in the process the rank server forked for it: run fn, send back what it returned.

    (It lives here rather than in _rankserver.py so that each rank runs the parlab code on disk.)"""
    # comm.progress() in rank code reports through the same pipe
    comm.progress_hook = lambda update: out.send_bytes(pickle.dumps({"progress": update}))
    board = _CallBoard(slot, rank, job["world_size"])
    comm.call_hook = board.hook
    _seed_generators(job["seed"] + rank)
    torch.set_default_dtype(job["default_dtype"])
    try:
        fn, args, kwargs = pickle.loads(job["fn"])
        if job["backend"] == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            job["backend"],
            init_method=f"file://{job['rendezvous']}",
            rank=rank,
            world_size=job["world_size"],
        )
        out.send_bytes(pickle.dumps({"progress": {"rank": rank, "started": True}}))
        comm.reset_trace()
        value = fn(*args, **kwargs)
        message = {"rank": rank, "ok": True, "payload": _pack_result(rank, value, comm.trace_events())}
    except _Unsendable as exc:  # the pickling error is the whole story: no traceback into parlab's code
        error = "".join(traceback.format_exception_only(exc.__cause__)) if exc.__cause__ else ""
        message = {"rank": rank, "ok": False, "reason": str(exc), "traceback": error}
    except BaseException:
        message = {"rank": rank, "ok": False, "traceback": traceback.format_exc()}
    message["stdout"] = captured.getvalue()
    board.publish(done=True)
    out.send_bytes(pickle.dumps(message))
    if message["ok"] and dist.is_initialized():
        # Leave together: a rank that tore down early could break a peer's last collective.
        dist.barrier()
        dist.destroy_process_group()
    out.close()


# ------------------------------------------------------------------------------------------------- progress

# Rank code reports progress with parlab.comm.progress (re-exported here and as parlab.progress).
progress = comm.progress


class _ProgressLine:
    """Progress of a launch longer than 1 s ("4/4 ranks started, step 3/10 after 5 s"), where someone watches.

    In a notebook: an HTML progress bar under the cell, updated in place. It is HTML only, which nbval does not
    compare (conftest.py), because its figures depend on timing; under pytest it is not shown at all. In a
    terminal: one line on stderr, rewritten in place.
    """

    DELAY = 1.0  # seconds before the progress appears: quick launches stay silent
    FORCE: bool | None = None  # tests set True (show on stderr even without a terminal) or False

    def __init__(self, world_size: int):
        self.world_size, self.started, self.steps = world_size, set(), {}
        self.began, self.last, self.handle = time.perf_counter(), None, None
        self.waiting = ""  # the longest wait in a traced call, in words (set by launch)
        self.notebook = _in_notebook() and "PYTEST_CURRENT_TEST" not in os.environ
        watched = self.notebook or sys.stderr.isatty()
        self.enabled = watched if self.FORCE is None else self.FORCE

    def update(self, update: dict) -> None:
        if update.get("started"):
            self.started.add(update["rank"])
        else:
            self.steps[update["rank"]] = update

    def _state(self) -> tuple[str, int, int]:
        """(text, done, total) for the slowest rank."""
        text = f"{len(self.started)}/{self.world_size} ranks started"
        done, total = len(self.started), self.world_size
        if self.steps:
            slowest = min(self.steps.values(), key=lambda u: u["done"])
            text += f", {slowest['what']} {slowest['done']}/{slowest['total']}"
            done, total = slowest["done"], slowest["total"]
        text += f" after {time.perf_counter() - self.began:.0f} s"
        if self.waiting:  # a rank stuck in a call: say which while it lasts
            text += f"; {self.waiting}"
        return text, done, total

    def show(self, final: bool = False) -> None:
        if not self.enabled or (time.perf_counter() - self.began < self.DELAY and not final):
            return
        text, done, total = self._state()
        if text == self.last and not final:
            return
        self.last = text
        if self.notebook and self.FORCE is None:
            self._show_html(text, done, total)
        else:
            sys.stderr.write("\r" + text + ("\n" if final else ""))
            sys.stderr.flush()

    def _show_html(self, text: str, done: int, total: int) -> None:
        from IPython.display import display

        html = {
            "text/html": f'<div style="font: 13px monospace; color: #555"><progress value="{done}" max="{total}" '
            f'style="width: 12em; vertical-align: middle"></progress> {html_escape(text)}</div>'
        }
        if self.handle is None:
            self.handle = display(html, raw=True, display_id=True)
        else:
            self.handle.update(html, raw=True)

    def close(self) -> None:
        if self.last is not None:  # it was shown: leave the final state
            self.show(final=True)


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (where HTML output is displayed)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


# ----------------------------------------------------------------------------------------- rank-side helpers


def init_from_env(backend: str | None = None) -> None:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    This is how the same rank code runs beyond one machine:
        torchrun --standalone --nproc-per-node 4 -m parlab run collectives
    """
    if dist.is_initialized():
        return
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend is None:  # one GPU per process on this machine: NCCL
        backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method="env://")


def under_torchrun() -> bool:
    """True in a process started by torchrun (and not by parlab.launch)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "PARLAB_LAUNCHED" not in os.environ)


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------------- warm from the start


def _warm_at_import() -> bool:
    """Whether importing parlab starts the rank server: in a Jupyter kernel, or wherever PARLAB_WARM=1.

    Never in a rank itself, nor under torchrun; PARLAB_WARM=0 turns it off in a kernel too."""
    if "PARLAB_LAUNCHED" in os.environ or under_torchrun():
        return False
    setting = os.environ.get("PARLAB_WARM", "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return _in_notebook()


if _warm_at_import():
    try:
        warm_up()  # returns at once: the server imports torch in its own process while the kernel goes on
    except OSError:  # never let warming up break an import: the first launch will say what is wrong
        pass
