"""The rank server: a long-lived process that has imported torch once and forks ranks on demand.

Why it exists: starting a rank with `torch.multiprocessing.spawn` costs a fresh interpreter that imports torch
(~2 s per rank here), and `spawn` cannot run a function defined in a notebook cell. This server pays the torch
import once; each launch then only forks `world_size` copies of it (a few milliseconds each), and the function
arrives by value (cloudpickle), so notebook functions work.

It runs as a plain script (`python rankserver.py FD`), not as `parlab.runtime.rankserver`: the server must not import
the parlab package, so that every forked rank imports parlab fresh from disk and never runs stale code. What a rank
does once forked lives in `parlab.runtime.rank._rank_main`, for the same reason.

Protocol (over the socket inherited as file descriptor FD; each message is one dict pickled by plain pickle; the
parent sends and receives from its own threads, so a Ctrl-C in the parent never cuts a message in half):
    server -> parent   {"ready": pid, "tmp": folder}    once, when torch is imported (rendezvous files go in folder)
    parent -> server   {"job": {...}}                   start the ranks of a job. A job that arrives while another
                                                        runs stops that one: its launch was abandoned.
    parent -> server   {"cancel": job_id}               stop the ranks of that job now
    server -> parent   {"job_id", "progress": ...}      a rank started, or reported progress (parlab.progress)
    server -> parent   {"job_id", "calls": [...], "at"} each rank's published call state, read at time.monotonic()
                                                        "at"; sent when it changed, and every CALLS_RESEND s
    server -> parent   {"job_id", "report": {...}}      every rank's outcome, sent once the ranks are all gone;
                                                        the answer to a cancel too ({"report": None} when that job
                                                        was not running)
What a rank returned travels inside the report as bytes that the rank pickled with cloudpickle: the server never
unpickles it (it has imported neither parlab nor the user's modules) and forgets the report once it is sent.
"""

import ctypes
import glob
import importlib
import io
import mmap
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait

# Run as a script, Python puts this folder first on sys.path, where runtime's own modules (errors, rank, ...) would
# shadow any top-level module of those names that torch might import: take it off.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import cloudpickle  # noqa: F401  (preloaded: the ranks unpickle the shipped function with it)
import torch
import torch._dynamo  # noqa: F401  (preloaded: the first torch.optim optimizer imports it, ~3 s per rank)

PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
PR_SET_CHILD_SUBREAPER = 36  # prctl: orphaned descendants become this process's children
RENDEZVOUS_PREFIX = "parlab-rendezvous-"  # + "<server pid>-<job id>", in the temp folder
CALLS_EVERY = 0.25  # seconds between two looks at the ranks' published calls
CALLS_RESEND = 1.0  # seconds after which they are sent again even if unchanged (the parent sees they still hold)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the server) dies, so no rank is ever orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the server still kills its ranks on every exit path
        pass


def _become_subreaper() -> None:
    """Orphans (a process the rank code started in a new session with setsid, whose rank then died) become this
    server's children instead of init's, so that _stop_adopted finds and stops them after each job."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):  # not Linux: a process started with setsid may outlive its rank
        pass


def _stop_adopted(rounds: int = 20) -> None:
    """Kill and reap every child of this server: once a job's ranks are reaped, any child left is an orphan the
    server adopted (as subreaper) from rank code. Killing one can orphan its own children: repeat until none."""
    for _ in range(rounds):
        adopted = _children(os.getpid())
        if not adopted:
            return
        for pid in adopted:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in adopted:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc; [] where there is none)."""
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            found += [int(child) for child in open(task).read().split()]
        except OSError:
            pass
    return found


def _run_rank(job: dict, rank: int, out: Connection, slot: memoryview, err_fd: int) -> None:
    """Body of one forked rank: set up the process, then hand over to parlab.runtime.rank._rank_main. Never returns:
    whatever fails in here ends this process, which must never fall back into the server's own loop.

    err_fd: a file for what the process itself writes to its stderr (file descriptor 2: gloo's C++ messages, a
    fatal error), which the server reads after the rank has exited: a rank that aborts is explained by it."""
    captured = io.StringIO()  # the rank's prints go back to the parent, which shows them in rank order
    try:
        os.dup2(err_fd, 2)
        os.close(err_fd)
        _die_with_parent()
        os.setpgid(0, 0)  # its own process group: whatever the rank code starts is stopped with it (killpg)
        # The parent's environment as it is at this launch (not as it was when the server started), plus the rank's.
        os.environ.clear()
        os.environ.update(job["env"])
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(job["world_size"]),
            LOCAL_WORLD_SIZE=str(job["world_size"]),
            GLOO_SOCKET_IFNAME="lo",  # gloo's own sockets on loopback too, not on the machine's network
            NCCL_SOCKET_IFNAME="lo",
            PARLAB_LAUNCHED="1",
        )
        sys.path[:] = job["sys_path"]
        os.chdir(job["cwd"])
        torch.set_num_threads(job["threads"])
        sys.stdout = sys.stderr = captured
        # (importlib: the package attribute parlab.launch is the launch function, not the module)
        rank_main = importlib.import_module("parlab.runtime.rank")._rank_main
    except BaseException:  # the set-up failed, or parlab itself does not import (a file being edited): say why
        try:
            message = {"rank": rank, "ok": False, "traceback": traceback.format_exc(), "stdout": captured.getvalue()}
            out.send_bytes(pickle.dumps(message))
        finally:
            os._exit(1)
    try:
        rank_main(job, rank, out, slot, captured)  # sends the rank's message itself
    except BaseException:
        os._exit(1)  # _rank_main reports every error of the rank code: this is a bug in parlab, or a kill
    os._exit(0)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _remove_stale_rendezvous_files() -> None:
    """Remove rendezvous files left by servers that were killed (their pid is gone)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), RENDEZVOUS_PREFIX + "*-*")):
        pid = os.path.basename(path)[len(RENDEZVOUS_PREFIX) :].split("-")[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                _remove(path)
            except OSError:
                pass
        except (ValueError, OSError):  # not ours, or another user's live server
            pass


def _kill(pids: dict) -> None:
    """SIGKILL each rank's process group: the rank and every process its code started."""
    for pid in pids.values():
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _read_slots(board: mmap.mmap, world_size: int, slot_bytes: int) -> list:
    """Each rank's published call state (JSON bytes; None while a rank is writing it). Layout of a slot:
    8-byte sequence number (odd while the rank writes), 4-byte length, the JSON text."""
    states = []
    for rank in range(world_size):
        base, state = rank * slot_bytes, None
        for _ in range(3):
            before = int.from_bytes(board[base : base + 8], "little")
            length = int.from_bytes(board[base + 8 : base + 12], "little")
            data = board[base + 12 : base + 12 + min(length, slot_bytes - 12)]
            if before % 2 == 0 and int.from_bytes(board[base : base + 8], "little") == before:
                state = data
                break
        states.append(state)
    return states


def _run_job(job: dict, parent: Connection) -> tuple[dict, dict | None]:
    """Fork the ranks, wait for each one's message and exit, stop them all at the first failure or cancel.

    Returns the report and the next request if one arrived meanwhile (a new job)."""
    # Rendezvous through a file that only this job knows: no TCP port to pick, so two launches at the same
    # time (two notebooks, parallel tests) can never meet each other's ranks. Gloo itself binds to loopback.
    job["rendezvous"] = os.path.join(tempfile.gettempdir(), f"{RENDEZVOUS_PREFIX}{os.getpid()}-{job['id']}")
    world_size, slot_bytes = job["world_size"], job["slot_bytes"]
    # Shared memory where each rank publishes the traced call it is in (parlab.comm), for the hang diagnosis.
    board = mmap.mmap(-1, world_size * slot_bytes)
    pids, pipes, errs = {}, {}, {}
    messages, exited, first_failure, cancelled, next_request = {}, set(), None, False, None
    try:
        for rank in range(world_size):
            reader, writer = os.pipe()
            errs[rank] = tempfile.TemporaryFile()  # already unlinked: nothing is left behind, even after a kill
            pid = os.fork()
            if pid == 0:  # the rank
                os.close(reader)
                for other in pipes.values():
                    other.close()
                parent.close()
                slot = memoryview(board)[rank * slot_bytes : (rank + 1) * slot_bytes]
                _run_rank(job, rank, Connection(writer, readable=False), slot, errs[rank].fileno())
            try:
                os.setpgid(pid, pid)  # also here, so that a kill right after the fork reaches the whole group
            except (PermissionError, ProcessLookupError):
                pass
            os.close(writer)
            pids[rank], pipes[rank] = pid, Connection(reader, writable=False)

        last_calls, last_look, last_sent = None, 0.0, 0.0
        while len(exited) < len(pids):
            ready = wait([parent, *[pipes[r] for r in pids if r not in exited]], timeout=CALLS_EVERY)
            if time.monotonic() - last_look >= CALLS_EVERY:
                last_look = time.monotonic()
                calls = _read_slots(board, world_size, slot_bytes)
                if calls != last_calls or last_look - last_sent >= CALLS_RESEND:
                    parent.send_bytes(pickle.dumps({"job_id": job["id"], "calls": calls, "at": last_look}))
                    last_calls, last_sent = calls, last_look
            if parent in ready:
                request = pickle.loads(parent.recv_bytes())  # EOFError if the parent died: main() exits
                if "job" in request:  # the parent gave up on this job (interrupted) and wants the next one
                    next_request, cancelled = request, True
                    _kill(pids)
                elif request.get("cancel") == job["id"]:
                    cancelled = True
                    _kill(pids)
                elif "cancel" in request:  # for a job that has already ended
                    parent.send_bytes(pickle.dumps({"job_id": request["cancel"], "report": None}))
            for rank, pipe in pipes.items():
                if pipe not in ready or rank in exited:
                    continue
                try:
                    message = pickle.loads(pipe.recv_bytes())
                    if "progress" in message:  # not the rank's result: pass it on to the parent as it comes
                        parent.send_bytes(pickle.dumps({**message, "job_id": job["id"]}))
                        continue
                    messages[rank] = message
                    failed = not message["ok"]
                except EOFError:  # the rank's process is gone
                    exited.add(rank)
                    failed = rank not in messages
                if failed and first_failure is None and not cancelled:
                    # A rank that raised may only be the victim of a peer that died without a word (its socket
                    # closed: "Connection reset by peer"); that peer's exit is seen a moment later. Name it.
                    silent = _silent_death(pipes, messages, exited) if rank in messages else None
                    first_failure = rank if silent is None else silent
                    _kill(pids)  # stop the other ranks at once: they would only hang on the dead peer
    finally:
        # Every exit path: stop what the ranks started (their process groups still exist while they are zombies),
        # reap them, and remove the rendezvous file (ranks that were killed could not remove it themselves).
        _kill(pids)
        for pipe in pipes.values():
            pipe.close()
        exit_codes = {}
        for rank, pid in pids.items():
            _, status = os.waitpid(pid, 0)
            exit_codes[rank] = os.waitstatus_to_exitcode(status)
        _stop_adopted()  # what the rank code started in sessions of its own, out of reach of killpg
        _remove(job["rendezvous"])
        board.close()
        stderr_tails = {rank: _tail_and_pass_on(err) for rank, err in errs.items()}
    report = {
        "messages": messages,
        "first_failure": first_failure,
        "cancelled": cancelled,
        "exit_codes": exit_codes,
        "stderr_tails": {rank: tail for rank, tail in stderr_tails.items() if tail},
    }
    return report, next_request


def _silent_death(pipes: dict, messages: dict, exited: set, within: float = 0.25) -> int | None:
    """After a rank reported an error: a rank whose process ended without any message within `within` seconds
    (os._exit, a crash, a kill), or None. Messages read meanwhile are kept as the main loop would keep them."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        waiting = {pipes[r]: r for r in pipes if r not in exited}
        ready = wait(list(waiting), timeout=left)
        if not ready:
            return None
        for pipe in ready:
            rank = waiting[pipe]
            try:
                message = pickle.loads(pipe.recv_bytes())
                if "progress" not in message:
                    messages[rank] = message
            except EOFError:
                exited.add(rank)
                if rank not in messages:
                    return rank
    return None


def _tail_and_pass_on(err, tail_bytes: int = 4096) -> str:
    """What a rank wrote to its own stderr: passed on to the server's stderr (where it went before it was
    captured), and its last `tail_bytes` returned for the report."""
    try:
        err.seek(0, os.SEEK_END)
        size = err.tell()
        if size:
            err.seek(0)
            shutil.copyfileobj(err, sys.stderr.buffer)
            sys.stderr.flush()
            err.seek(max(0, size - tail_bytes))
            return err.read().decode("utf-8", "replace")
        return ""
    except (OSError, ValueError):
        return ""
    finally:
        err.close()


def main(fd: int) -> None:
    parent = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the kernel is handled by the parent, not here
    _become_subreaper()
    _remove_stale_rendezvous_files()
    try:
        parent.send_bytes(
            pickle.dumps({"ready": os.getpid(), "tmp": tempfile.gettempdir()})
        )  # torch is imported: launches are fast from now
        request = None
        while True:
            request = request or pickle.loads(parent.recv_bytes())
            if "cancel" in request:  # its job has already ended (or never arrived): say so
                parent.send_bytes(pickle.dumps({"job_id": request["cancel"], "report": None}))
                request = None
                continue
            job_id, started = request["job"]["id"], time.perf_counter()
            report, request = _run_job(request["job"], parent)
            report["server_seconds"] = time.perf_counter() - started
            parent.send_bytes(pickle.dumps({"job_id": job_id, "report": report}))
            del report  # keep nothing of a finished job: its results can be large
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the parent went away: _run_job has killed the ranks on its way out


if __name__ == "__main__":
    main(int(sys.argv[1]))
