"""The rank server's processes (server side): each rank runs in a worker, a process forked from the server.

A worker is forked either when a job needs it, or ahead of need (a spare): a spare sets itself up for the last
job's environment, imports parlab's rank code, and waits on a pipe until a job hands it a rank. A job then costs
only what is left: gloo's rendezvous and the function itself. (A fork of the torch-importing server costs ~10 ms of
the server's time, and importing parlab ~20 ms of the rank's; on 2 cores, four ranks pay that several times over.)

This file is loaded by `rankserver.py` from its path, never as `parlab.runtime.workers`: the server must not import
the parlab package. When may a spare serve a job? Only when it was prepared for the same `sys.path`, current folder
and environment (see `spec_key`), and the parlab files on disk are still those it imported (`package_fingerprint`,
taken before its import and again at the job): a spare never runs stale code. Any other spare is killed.
"""

import ctypes
import fcntl
import importlib
import importlib.util
import io
import mmap
import os
import pickle
import signal
import sys
import tempfile
import traceback
from multiprocessing.connection import Connection

import torch

PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
PR_SET_NAME = 15  # the process's name in ps and /proc/PID/comm: "parlab-spare", then "parlab-rank-N"
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032  # from <fcntl.h>
PIPE_BYTES = 1 << 20  # a job goes to a spare through a pipe this large; a larger job forks its ranks instead
MAX_SPARES = 8  # spares kept ready: the last job's world size, at most this many

# Environment variables that may differ between the spare's preparation and the job. Only variables read while
# parlab's rank code is imported could make a spare differ from a fresh rank (the job's exact environment is put in
# place before the rank code runs); pytest rewrites PYTEST_CURRENT_TEST at every test phase and nothing reads it at
# import. Any other difference (a notebook's os.environ["X"] = ...) retires the spares: safe, and rare.
ENV_NOISE = frozenset({"PYTEST_CURRENT_TEST"})

# What every rank process sets, on top of the parent's environment.
LAUNCHED_ENV = {
    "PARLAB_LAUNCHED": "1",  # read at import (parlab.runtime.under_torchrun, parlab.launch's warm-up)
    "GLOO_SOCKET_IFNAME": "lo",  # gloo's own sockets on loopback too, not on the machine's network
    "NCCL_SOCKET_IFNAME": "lo",
}

try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # not Linux
    _libc = None


def _prctl(option: int, value) -> None:
    if _libc is not None:
        try:
            _libc.prctl(option, value, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the server still kills its workers on every exit path
            pass


def spec_key(spec: dict) -> tuple:
    """What a spare must share with a job to serve it: sys.path, folder, environment (less ENV_NOISE), slot size,
    and whether it runs on a GPU ("cuda": an NCCL job's spares make their CUDA context ahead; a gloo job's must not
    hold one)."""
    env = tuple(sorted((k, v) for k, v in spec["env"].items() if k not in ENV_NOISE))
    return tuple(spec["sys_path"]), spec["cwd"], env, spec["slot_bytes"], spec.get("cuda", False)


def package_fingerprint(sys_path: list, cwd: str):
    """Where `import parlab` finds the package with this sys.path and folder, and the inode, mtime and size of
    every .py file in it; None if it is not found on disk (then no spare is used). Computed without importing it."""
    saved = sys.path[:]
    sys.path[:] = [os.path.join(cwd, entry) for entry in sys_path]  # "" is the job's folder, not the server's
    try:
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("parlab")
    except (ImportError, ValueError, OSError):
        return None
    finally:
        sys.path[:] = saved
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
        for name in names:
            if name.endswith(".py"):
                try:
                    st = os.stat(os.path.join(root, name))
                except OSError:
                    continue
                files.append((os.path.join(root, name), st.st_ino, st.st_mtime_ns, st.st_size))
    return folder, tuple(sorted(files))


class Worker:
    """One forked process that becomes one rank: a spare (job=None: it waits for its job on a pipe) or a rank
    forked for a job (it gets the job by inheritance: no copy of a large closure).

    Server side: `out` reads the rank's messages, `board` is its slot of the hang diagnosis (shared memory mapped
    before the fork), `err` the file its stderr goes to (unlinked: nothing is left behind, even after a kill)."""

    def __init__(self, spec: dict, fingerprint, close_in_child: list, job: tuple | None = None, slot: int = 0):
        self.key, self.fingerprint = spec_key(spec), fingerprint
        self.slot = slot  # a spare: the rank it is prepared to be (under NCCL, its GPU's context is made ahead)
        self.board = mmap.mmap(-1, spec["slot_bytes"])
        self.err = tempfile.TemporaryFile()
        job_reader, job_writer = os.pipe()
        out_reader, out_writer = os.pipe()
        self.pipe_bytes = 0  # how large a job may be handed through the pipe without blocking the server
        if job is None:
            try:
                fcntl.fcntl(job_writer, F_SETPIPE_SZ, PIPE_BYTES)
                self.pipe_bytes = fcntl.fcntl(job_writer, F_GETPIPE_SZ)
            except OSError:  # not Linux: spares are never used
                pass
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the server's loop
            try:
                for fd in [*close_in_child, job_writer, out_reader]:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                _worker_main(spec, job_reader, out_writer, self.board, self.err.fileno(), job, slot)
            finally:
                os._exit(1)
        try:
            os.setpgid(pid, pid)  # also here, so that a kill right after the fork reaches the whole group
        except (PermissionError, ProcessLookupError):
            pass
        os.close(job_reader)
        os.close(out_writer)
        self.pid = pid
        self.jobs = Connection(job_writer, readable=False)
        self.out = Connection(out_reader, writable=False)

    def fds(self) -> list[int]:
        """The server's descriptors of this worker, which every later-forked worker closes: a worker that kept a
        copy of another one's pipe would hide that one's exit (no EOF) from the server."""
        fds = [conn.fileno() for conn in (self.jobs, self.out) if not conn.closed]
        return fds if self.err.closed else [*fds, self.err.fileno()]

    def start(self, rank: int, job_bytes: bytes) -> bool:
        """Hand a spare its rank and job (fits in the pipe: never blocks). False if the spare is gone."""
        try:
            self.jobs.send_bytes(rank.to_bytes(4, "little") + job_bytes)
            return True
        except OSError:
            return False
        finally:
            self.jobs.close()

    def kill(self) -> None:
        """SIGKILL the worker's process group: the rank and every process its code started."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self) -> int:
        """Wait for the (killed or finished) worker's exit; close the server's ends. Returns its exit code."""
        for conn in (self.jobs, self.out):
            conn.close()
        try:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = None
        self.board.close()
        return code


def _worker_main(spec: dict, job_reader: int, out_writer: int, board: mmap.mmap, err_fd: int, job, slot: int) -> None:
    """Body of a worker: set the process up, import parlab's rank code (a spare does this before any job), take
    the job, hand over to parlab.runtime.rank._rank_main. Whatever fails ends this process."""
    captured = io.StringIO()  # the rank's prints go back to the parent, which shows them in rank order
    out = Connection(out_writer, readable=False)
    rank, rank_main, failure = None, None, None
    try:
        os.dup2(err_fd, 2)  # what the process itself writes (gloo's C++ messages, a fatal error): read after exit
        os.close(err_fd)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the server: a worker is never orphaned
        os.setpgid(0, 0)  # its own process group: whatever the rank code starts is stopped with it (killpg)
        _prctl(PR_SET_NAME, b"parlab-spare" if job is None else b"parlab-rank")
        _enter(spec["env"], spec["sys_path"], spec["cwd"], {})
        sys.stdout = sys.stderr = captured
        # (importlib: the package attribute parlab.launch is the launch function, not the module)
        rank_module = importlib.import_module("parlab.runtime.rank")
        rank_main = rank_module._rank_main
        if job is None and hasattr(rank_module, "_prepare_spare"):
            try:
                rank_module._prepare_spare(slot if spec.get("cuda") else None)
            except Exception:  # only a head start: the job does all of it again
                pass
    except BaseException:  # the set-up failed, or parlab itself does not import (a file being edited): say why
        failure = traceback.format_exc()
    try:
        if job is None:
            with Connection(job_reader, writable=False) as jobs:
                data = jobs.recv_bytes()  # EOFError: retired without a job
            rank, job = int.from_bytes(data[:4], "little"), pickle.loads(data[4:])
        else:
            os.close(job_reader)
            rank, job = job
        _prctl(PR_SET_NAME, f"parlab-rank-{rank}".encode())
        # The parent's environment as it is at this launch (not as it was when the server started), plus the rank's.
        world = str(job["world_size"])
        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
        _enter(job["env"], job["sys_path"], job["cwd"], ranks)
        torch.set_num_threads(job["threads"])
    except EOFError:
        os._exit(0)
    except BaseException:
        failure = failure or traceback.format_exc()
    if failure is not None:
        message = {"rank": rank, "ok": False, "traceback": failure, "stdout": captured.getvalue()}
        out.send_bytes(pickle.dumps(message))
        os._exit(1)
    try:
        slot = memoryview(board)[: job["slot_bytes"]]
        rank_main(job, rank, out, slot, captured)  # sends the rank's message itself, then waits to be stopped
    except BaseException:
        os._exit(1)  # _rank_main reports every error of the rank code: this is a bug in parlab, or a kill
    os._exit(0)


def _enter(env: dict, sys_path: list, cwd: str, rank_env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(LAUNCHED_ENV, **rank_env)
    sys.path[:] = sys_path
    os.chdir(cwd)


class Spares:
    """The spares the server keeps ready, for the environment of the last job that asked for them."""

    def __init__(self):
        self.ready: list[Worker] = []
        self.retired: list[Worker] = []  # killed, to be reaped after the job (not on its critical path)

    def take(self, spec: dict, count: int, job_bytes: int) -> list[Worker]:
        """Up to `count` spares fit for this job (same key, parlab unchanged on disk, the job fits in their pipe);
        every other spare is retired."""
        fits = []
        if count > 0 and self.ready:
            key, fingerprint = spec_key(spec), package_fingerprint(spec["sys_path"], spec["cwd"])
            fits = [s for s in self.ready if s.key == key and s.fingerprint == fingerprint and fingerprint is not None]
            fits = [s for s in fits if job_bytes + 4 <= s.pipe_bytes][:count]
        for spare in self.ready:
            if spare not in fits:
                self.retire(spare)
        self.ready = []
        return fits

    def retire(self, spare: Worker) -> None:
        """Kill a spare that will not serve; it is reaped after the job (not on its critical path)."""
        spare.kill()
        self.retired.append(spare)

    def reap_retired(self) -> None:
        for spare in self.retired:
            spare.reap()
            spare.err.close()
        self.retired = []

    def top_up(self, spec: dict, count: int, close_in_child, busy) -> None:
        """Fork spares until `count` are ready (the last job's world size, at most MAX_SPARES; 0: none wanted),
        stopping as soon as `busy()` says a request waits: the spares ready by then serve it."""
        count = min(count, MAX_SPARES)
        while len(self.ready) > count:
            self.retire(self.ready.pop())
        if len(self.ready) >= count or busy():
            return
        fingerprint = package_fingerprint(spec["sys_path"], spec["cwd"])  # before the spares import parlab
        if fingerprint is None:
            return
        while len(self.ready) < count and not busy():  # spare k is prepared as rank k (see _run_job)
            self.ready.append(Worker(spec, fingerprint, [*close_in_child(), *self.fds()], slot=len(self.ready)))

    def fds(self) -> list[int]:
        """The server's descriptors of every spare (which a newly forked worker closes)."""
        return [fd for spare in self.ready + self.retired for fd in spare.fds()]

    def pids(self) -> set[int]:
        return {spare.pid for spare in self.ready}
