"""Run one function on N ranks, from a notebook cell, a script or a test.

    results = parlab.launch(fn, 4, x, steps=3)   # fn(x, steps=3) runs on ranks 0..3, torch.distributed ready
    results[2]                                    # what rank 2 returned (tensors come back as CPU tensors)
    results.trace                                 # every traced collective and compute span, from all ranks

Each rank is a real process with its own `torch.distributed` process group (gloo on CPU, NCCL when there is one
GPU per rank). The processes are forked by a rank server that imported torch once (see `runtime/rankserver.py`), so a
warm launch costs a fraction of a second; in a Jupyter kernel (or with PARLAB_SPARES=1) the server also prepares the
next launch's ranks ahead of it (`runtime/workers.py`): each launch still gets new processes. `fn` travels by
value (cloudpickle), and so do the values the ranks return: a function or a dataclass written in a notebook cell
works both ways.

The rank server starts in the background as soon as parlab is imported in a Jupyter kernel, so that the first
launch of a lesson is as fast as the others; elsewhere (scripts, tests) it starts at the first launch, or at
`warm_up()`, or at import when the environment variable PARLAB_WARM=1 (PARLAB_WARM=0: never at import).

While the ranks run, each one publishes the traced call it is in (`parlab.core.comm`); `launch` stops ranks that wait in
calls that can never match (e.g. rank 0 in all_reduce, rank 1 in broadcast) after `MISMATCH_SECONDS` and raises
`CollectiveMismatch` naming each rank's call.

Beyond one machine, the same rank code runs under `torchrun` instead: `parlab.init_from_env()` sets up the process
group from torchrun's environment (see `python -m parlab run --help`). parlab never launches multi-node jobs itself.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from parlab.core import comm, scratch
from parlab.core.trace import Trace
from parlab.runtime import DEFAULT_TIMEOUT, SLOT_BYTES, under_torchrun
from parlab.runtime.errors import CollectiveMismatch, LaunchTimeout, RankError, Results
from parlab.runtime.hang import _died, _HangWatch, _mismatch
from parlab.runtime.progress import _in_notebook, _ProgressLine
from parlab.runtime.server import _get_server, _RankServer, _retire, warm_up

_lock = threading.Lock()  # one launch at a time per parent process
_job_ids = itertools.count()  # a message names its job: one left over from an interrupted launch is ignored


def _forget_lock_in_child() -> None:
    """A forked process launches on its own (see runtime.server._forget_server_in_child)."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_lock_in_child)

# --------------------------------------------------------------------------------------------------- launching


def gpu_count() -> int:
    """The GPUs this process may use, counted without starting CUDA here (torch.cuda.device_count asks NVML where
    it can; torch.cuda.is_available() would initialise the driver in this process: ~0.5 s, for nothing)."""
    return torch.cuda.device_count()


def default_backend(world_size: int) -> str:
    """NCCL when there is one GPU per rank, gloo otherwise."""
    return "nccl" if gpu_count() >= world_size else "gloo"


def check_launch_args(fn: Any, world_size: Any, backend: str | None, timeout: float, threads: Any = None) -> str:
    """Reject bad arguments before any process starts; return the backend to use."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be None (share the cores out) or an int >= 1, got {threads!r}")
    cores = os.cpu_count() or 1
    if threads is not None and threads > cores:  # (more threads than cores only wait for each other; a million
        raise ValueError(  # of them cannot even be started: the ranks died making them)
            f"threads must be at most this machine's {cores} CPU cores (threads per rank), got {threads}"
        )
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
        gpus = gpu_count()
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
    collective work, and `parlab.core.comm` records what the rank communicates.

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
        "stream_events": comm.event_sink is not None,  # a live timeline (parlab.live) is watching
        "spares": int(_spares_wanted()),  # keep ranks ready for the next launch (see _spares_wanted)
        "scratch": scratch.owned(),  # this process's scratch folders: the server removes them if it is killed
    }
    job_id, request = job["id"], pickle.dumps({"job": job})
    del job  # the pickled request is what travels: no second copy of a large closure while the ranks run
    with _lock:
        server = _get_server()
        progress = _ProgressLine(world_size)  # shown from now: a cold start (importing torch) takes seconds too
        try:
            progress.starting, server.on_wait = not server.ready.is_set(), progress.show
            server.wait_ready()
        except KeyboardInterrupt:
            progress.close()
            if not server.warm:  # a launch interrupted while its server starts leaves no server behind
                _retire(server)
            raise
        except RuntimeError:
            progress.close()
            _retire(server)
            raise
        finally:
            progress.starting, server.on_wait = False, None
        started = time.perf_counter()
        server.outbox.put(request)
        del request
        report, stopped, calls = _wait_for_report(server, job_id, timeout, world_size, progress)
        seconds = time.perf_counter() - started
    results = _results_from(report, stopped, calls, world_size, timeout, seconds, echo, seed)
    results.backend = backend
    # Each rank's phases, in seconds after the job was handed over (perf_counter is one clock for every process).
    results.phases = [
        {name: at - started for name, at in report["messages"].get(rank, {}).get("phases", {}).items()}
        for rank in range(world_size)
    ]
    return results


def _spares_wanted() -> bool:
    """Whether the rank server prepares the ranks of the next launch ahead of it (spares: forked, parlab imported,
    waiting for a job; a warm launch then takes ~half the time). PARLAB_SPARES=1 or 0; by default in a Jupyter
    kernel only, where launches are interactive. A spare is a process of the rank server between launches: code
    that counts the server's children sees them (processes named "parlab-spare"). It never runs two launches, nor
    stale parlab code, nor in another folder, sys.path or environment than it was prepared for."""
    setting = os.environ.get("PARLAB_SPARES", "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return _in_notebook()


def _wait_for_report(server: _RankServer, job_id: int, timeout: float, world_size: int, progress: _ProgressLine):
    """Wait for the job's report, showing progress and watching for hangs; on a timeout, a mismatch or Ctrl-C,
    stop the ranks first. Returns (report, why the ranks were stopped: None, "timeout" or a CollectiveMismatch,
    each rank's last known state in words)."""
    watch = _HangWatch(world_size)
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
                    progress.close(reported=True)
                    return message["report"], None, watch.describe()
                if "events" in message.get("progress", {}):  # a rank's events, for a live timeline
                    if comm.event_sink is not None:
                        comm.event_sink(message["progress"])
                elif "progress" in message:
                    progress.update(message["progress"])
                elif "calls" in message:
                    watch.update(message["calls"], message["at"])
            mismatch = watch.mismatch()
            if mismatch is not None:
                stopped = mismatch
                break
            progress.waiting = watch.longest_wait()
            progress.show()
            if comm.event_sink is not None:
                comm.event_sink(None)  # a tick: the live timeline moves its "now" line
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
    if stopped == "timeout" and failed is None and all(messages.get(r, {}).get("ok") for r in range(world_size)):
        stopped = None  # every rank had returned: the timeout came while their (large) results were on their way
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
    return Results(values, Trace(events, world_size), stdout, seconds, seed, report.get("spares", 0))


# gloo's words when the ranks of one collective disagree on its size ("Received data size doesn't match expected
# size"; "... size mismatch"): it aborts the process from C++, so they reach only the rank's own stderr.
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
    kwargs = {}
    if backend == "nccl":  # this process's GPU; device_id: NCCL's communicator is made now, not at the first call
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    store = _store_of_this_attempt(world_size)
    if store is None:
        dist.init_process_group(backend, init_method="env://", **kwargs)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size, **kwargs)
    # One process group for the life of the process: several schemes can run one after another in it (torchrun's
    # store does not take a second group of the same name), and it is torn down once, on the way out.
    atexit.register(_destroy_at_exit)


def _store_of_this_attempt(world_size: int) -> dist.Store | None:
    """The store this attempt's process group meets in, when torchrun's agent shares its own (c10d rendezvous).

    The agent's store outlives a restart of the group, and so do the keys a group writes to it: each gloo rank's
    address, under the same names every attempt. A restarted rank could read the address of a peer torchrun had
    just stopped and fail to connect, or hang (pytorch#135712; here one elastic restart in three). So each attempt
    writes under a prefix of its own: the agent's restart count. (That count is kept by each agent: on several
    nodes it agrees when every node's workers failed, as they do when a peer dies mid-collective; where it does
    not, the ranks wait apart until the store's timeout, and torchrun restarts them again.) None where the agent
    does not share its store: init_method="env://" then makes a fresh one each attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    return dist.PrefixStore(f"parlab/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)


def _destroy_at_exit() -> None:
    """On a clean exit only: after an error a peer may be gone, and tearing the group down could wait for it (the
    agent would then wait for this process before it restarts the group); the operating system closes its sockets."""
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()


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
