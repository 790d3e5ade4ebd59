"""Run one function on N ranks, from a notebook cell, a script or a test.

    results = parlab.launch(fn, 4, x, steps=3)   # fn(x, steps=3) runs on ranks 0..3, torch.distributed ready
    results[2]                                    # what rank 2 returned (tensors come back as CPU tensors)
    results.trace                                 # every traced collective and compute span, from all ranks

Each rank is a real process with its own `torch.distributed` process group (gloo on CPU, NCCL when there is one
GPU per rank). The processes are forked by a rank server that imported torch once (see `_rankserver.py`), so a
warm launch costs a fraction of a second, and `fn` travels by value, so a function written in a notebook cell
runs on the ranks.

Beyond one machine, the same rank code runs under `torchrun` instead: `parlab.init_from_env()` sets up the process
group from torchrun's environment (see `python -m parlab run --help`). parlab never launches multi-node jobs itself.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from html import escape as html_escape
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from parlab.trace import Trace

DEFAULT_TIMEOUT = 120.0  # seconds; long enough for any lesson at world size 8 on 2 CPU cores
SERVER_START_TIMEOUT = 300.0  # seconds for the rank server to import torch (slow disks, busy machines)


class RankError(RuntimeError):
    """A rank raised (or died). `rank` is the first rank that failed; `remote_traceback` is its traceback."""

    def __init__(self, rank: int, remote_traceback: str, stdout: str = ""):
        self.rank, self.remote_traceback, self.stdout = rank, remote_traceback, stdout
        text = f"rank {rank} failed; the other ranks were stopped.\n\n--- traceback on rank {rank} ---\n"
        text += remote_traceback.rstrip()
        if stdout.strip():
            text += f"\n--- rank {rank} printed ---\n{stdout.rstrip()}"
        super().__init__(text)


class LaunchTimeout(TimeoutError):
    """Some ranks had not finished when the timeout expired (a hang: e.g. mismatched collectives)."""

    def __init__(self, timeout: float, unfinished: list[int], world_size: int):
        self.unfinished = unfinished
        finished = sorted(set(range(world_size)) - set(unfinished))
        super().__init__(
            f"ranks {unfinished} had not finished after {timeout:g} s and were stopped "
            f"(finished: {finished or 'none'}). A hang like this usually means the ranks called "
            "different collectives, or a send without its matching recv."
        )


class Results(list):
    """What each rank returned, in rank order, plus the merged `trace` and each rank's printed `stdout`."""

    def __init__(self, values: list, trace: Trace, stdout: list[str], seconds: float):
        super().__init__(values)
        self.trace, self.stdout, self.seconds = trace, stdout, seconds


# ---------------------------------------------------------------------------------------------- the rank server


class _RankServer:
    """Handle on the rank-server process (one per parent process, started at the first launch)."""

    def __init__(self):
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        script = Path(__file__).with_name("_rankserver.py")
        self.process = subprocess.Popen(
            [sys.executable, str(script), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        # Wait until the server has imported torch, so that this start-up is not counted in a launch's timeout.
        if not self.conn.poll(SERVER_START_TIMEOUT):
            self.close()
            raise RuntimeError(f"the parlab rank server did not start within {SERVER_START_TIMEOUT} s")
        pickle.loads(self.conn.recv_bytes())  # {"ready": pid}

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self.conn.close()  # the server sees EOF and exits; its ranks die with it
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_server: _RankServer | None = None
_lock = threading.Lock()  # one launch at a time per parent process
_job_ids = itertools.count()  # a report names its job: one left over from an interrupted launch is ignored


def _get_server() -> _RankServer:
    global _server
    if _server is None or not _server.alive():
        if _server is not None:
            _server.close()
        _server = _RankServer()
    return _server


def shutdown() -> None:
    """Stop the rank server (it restarts at the next launch). Called automatically at exit."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


atexit.register(shutdown)


def rank_server_pid() -> int | None:
    """The rank server's process id (tests use it to check that no rank outlives its launch)."""
    return _server.process.pid if _server is not None and _server.alive() else None


# --------------------------------------------------------------------------------------------------- launching


def default_backend(world_size: int) -> str:
    """NCCL when there is one GPU per rank, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def check_launch_args(fn: Any, world_size: Any, backend: str | None, timeout: float) -> str:
    """Reject bad arguments before any process starts; return the backend to use."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
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
    timeout: seconds before unfinished ranks are stopped and `LaunchTimeout` names them.
    threads: torch threads per rank (default: the CPU cores shared out among the ranks, at least 1).
    echo: print what the ranks printed, grouped by rank in rank order, once they are done.

    Raises `RankError` (the failing rank and its traceback) if any rank raises; the other ranks are stopped.
    """
    backend = check_launch_args(fn, world_size, backend, timeout)
    threads = threads or max(1, available_cpus() // world_size)
    job = {
        "id": next(_job_ids),
        "fn": cloudpickle.dumps((fn, args, kwargs)),
        "world_size": world_size,
        "backend": backend,
        "threads": threads,
        "sys_path": list(sys.path),
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("PARLAB_", "PYTHON", "OMP_", "TORCH_"))},
    }
    with _lock:
        server = _get_server()
        started = time.perf_counter()
        server.conn.send_bytes(pickle.dumps({"job": job}))
        report = _wait_for_report(server, job["id"], timeout, world_size)
        seconds = time.perf_counter() - started
    return _results_from(report, world_size, timeout, seconds, echo)


def _wait_for_report(server: _RankServer, job_id: int, timeout: float, world_size: int) -> dict:
    """Wait for the server's report, showing the ranks' progress; on timeout or Ctrl-C stop the ranks first."""
    progress = _ProgressLine(world_size)
    deadline = time.perf_counter() + timeout
    try:
        while (remaining := deadline - time.perf_counter()) > 0:
            if server.conn.poll(min(remaining, 0.5)):
                message = pickle.loads(server.conn.recv_bytes())
                if message.get("job_id") != job_id:
                    continue  # left over from an interrupted launch
                if "progress" not in message:
                    progress.close()
                    return message
                progress.update(message["progress"])
            progress.show()
        progress.close()
        server.conn.send_bytes(pickle.dumps("cancel"))
        report = _next_report(server, job_id)
        report["timed_out"] = True
        return report
    except KeyboardInterrupt:
        progress.close()
        server.conn.send_bytes(pickle.dumps("cancel"))
        _next_report(server, job_id)  # the ranks are gone once the report arrives
        raise
    except (EOFError, OSError) as exc:
        shutdown()
        raise RuntimeError("the parlab rank server died; it will restart at the next launch") from exc


def _next_report(server: _RankServer, job_id: int) -> dict:
    """The report of job `job_id`, skipping progress messages still in the pipe."""
    while True:
        message = pickle.loads(server.conn.recv_bytes())
        if message.get("job_id") == job_id and "progress" not in message:
            return message


def _results_from(report: dict, world_size: int, timeout: float, seconds: float, echo: bool) -> Results:
    messages = report["messages"]
    stdout = [messages.get(r, {}).get("stdout", "") for r in range(world_size)]
    if report.get("timed_out") and report["first_failure"] is None:
        unfinished = [r for r in range(world_size) if not messages.get(r, {}).get("ok")]
        raise LaunchTimeout(timeout, unfinished, world_size)
    failed = report["first_failure"]
    if failed is not None:
        message = messages.get(failed)
        if message is None:  # the process died without a word (killed, segfault, os._exit)
            code = report["exit_codes"].get(failed)
            raise RankError(failed, f"the process exited with code {code} before returning a result")
        raise RankError(failed, message["traceback"], message.get("stdout", ""))
    if echo:
        for rank, text in enumerate(stdout):
            for line in text.splitlines():
                print(f"[rank {rank}] {line}")
    trace = Trace([event for r in range(world_size) for event in messages[r]["events"]], world_size)
    return Results([messages[r]["value"] for r in range(world_size)], trace, stdout, seconds)


# ------------------------------------------------------------------------------------------------- progress

_progress_channel = None  # in a launched rank: the pipe to the rank server (set by _rankserver)


def progress(done: int, total: int, what: str = "step") -> None:
    """Rank code: say how far this rank is; while the ranks run, the cell shows the slowest rank's progress.

    A no-op outside parlab.launch (e.g. under torchrun).
    """
    if _progress_channel is not None:
        update = {"rank": dist.get_rank(), "done": done, "total": total, "what": what}
        _progress_channel.send_bytes(pickle.dumps({"progress": update}))


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
        return text + f" after {time.perf_counter() - self.began:.0f} s", done, total

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
