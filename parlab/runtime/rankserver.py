"""The rank server: a long-lived process that has imported torch once and forks ranks on demand.

Why it exists: starting a rank with `torch.multiprocessing.spawn` costs a fresh interpreter that imports torch
(~2 s per rank here), and `spawn` cannot run a function defined in a notebook cell. This server pays the torch
import once; each launch then only forks `world_size` copies of it (~10 ms each here), and the function arrives by
value (cloudpickle), so notebook functions work. When the job asks for it ("spares": 1; by default in a Jupyter
kernel), the server forks the next launch's ranks once a launch is over, while the notebook goes on: spares, which
import parlab and wait for a job (runtime/workers.py). Every launch still gets new processes.

It runs as a plain script (`python rankserver.py FD`), not as `parlab.runtime.rankserver`: the server must not import
the parlab package, so that every forked rank imports parlab fresh from disk and never runs stale code (a spare
serves only if the parlab files are those it imported). What a rank does once forked lives in
`parlab.runtime.rank._rank_main`, for the same reason.

A launch ends without a barrier: a rank that has returned waits until every rank has, then the server kills them all
(killing a process group stops what the rank code started too). The report goes out once the ranks are reaped; with
spares, as soon as they are killed (they are reaped right after it, before the next job is read).

Protocol (over the socket inherited as file descriptor FD; each message is one dict pickled by plain pickle; the
parent sends and receives from its own threads, so a Ctrl-C in the parent never cuts a message in half):
    server -> parent   {"ready": pid, "tmp": folder}    once, when torch is imported (rendezvous files go in folder)
    parent -> server   {"job": {...}}                   start the ranks of a job. A job that arrives while another
                                                        runs stops that one: its launch was abandoned.
    parent -> server   {"cancel": job_id}               stop the ranks of that job now
    parent -> server   {"bye": True}                    the parent is shutting the server down (an EOF without
                                                        it means the parent died: see _remove_scratch)
    server -> parent   {"job_id", "progress": ...}      a rank started, or reported progress (parlab.progress)
    server -> parent   {"job_id", "calls": [...], "at"} each rank's published call state, read at time.monotonic()
                                                        "at"; sent when it changed, and every CALLS_RESEND s
    server -> parent   {"job_id", "report": {...}}      every rank's outcome, sent once the ranks are stopped;
                                                        the answer to a cancel too ({"report": None} when that job
                                                        was not running)
What a rank returned travels inside the report as bytes that the rank pickled with cloudpickle: the server never
unpickles it (it has imported neither parlab nor the user's modules) and forgets the report once it is sent.
"""

import ctypes
import glob
import importlib.util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait

# Run as a script, Python puts this folder first on sys.path, where runtime's own modules (errors, rank, ...) would
# shadow any top-level module of those names that torch might import: take it off.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

try:
    import cloudpickle  # noqa: F401  (preloaded: the ranks unpickle the shipped function with it)
    import torch
    import torch._dynamo  # noqa: F401  (preloaded: the first torch.optim optimizer imports it, ~3 s per rank)

    try:  # preloaded: every rank seeds NumPy's generator, and importing numpy.random costs a rank ~10 ms
        import numpy.random  # noqa: F401
    except ImportError:
        pass
    torch.manual_seed(0)  # its first call initialises lazily (~3-10 ms in each rank otherwise); each rank reseeds
except KeyboardInterrupt:  # Ctrl-C while torch loads reaches this process too: the parent says "interrupted"
    sys.exit(130)

PR_SET_CHILD_SUBREAPER = 36  # prctl: orphaned descendants become this process's children
RENDEZVOUS_PREFIX = "parlab-rendezvous-"  # + "<server pid>-<job id>", in the temp folder
CALLS_EVERY = 0.25  # seconds between two looks at the ranks' published calls
CALLS_RESEND = 1.0  # seconds after which they are sent again even if unchanged (the parent sees they still hold)


def _load_workers():
    """runtime/workers.py, loaded from its path under a name outside the parlab package (see the docstring)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers.py")
    spec = importlib.util.spec_from_file_location("_parlab_rankserver_workers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


workers = _load_workers()


def _become_subreaper() -> None:
    """Orphans (a process the rank code started in a new session with setsid, whose rank then died) become this
    server's children instead of init's, so that _stop_adopted finds and stops them after each job."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):  # not Linux: a process started with setsid may outlive its rank
        pass


def _stop_adopted(keep: set, rounds: int = 20) -> None:
    """Kill and reap every child of this server but the spares (`keep`): once a job's ranks are reaped, any other
    child is an orphan the server adopted (as subreaper) from rank code. Killing one can orphan its own children:
    repeat until none."""
    for _ in range(rounds):
        adopted = [pid for pid in _children(os.getpid()) if pid not in keep]
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


def _remove_scratch(folders: list) -> None:
    """The parent's scratch folders (offload files, checkpoints), which it could not remove itself: it died
    without saying bye (SIGKILL). Each entry is [folder, parents made to hold it...] (parlab/core/scratch.py)."""
    for folder, *made in folders:
        shutil.rmtree(folder, ignore_errors=True)
        for parent in made:  # deepest first; one that holds something else now stays
            try:
                os.rmdir(parent)
            except OSError:
                break


def _read_slots(boards: list) -> list:
    """Each rank's published call state (JSON bytes; None while a rank is writing it). Layout of a slot (one shared
    memory map per rank): 8-byte sequence number (odd while the rank writes), 4-byte length, the JSON text."""
    states = []
    for board in boards:
        state = None
        for _ in range(3):
            before = int.from_bytes(board[0:8], "little")
            length = int.from_bytes(board[8:12], "little")
            data = board[12 : 12 + min(length, len(board) - 12)]
            if before % 2 == 0 and int.from_bytes(board[0:8], "little") == before:
                state = data
                break
        states.append(state)
    return states


def _run_job(job: dict, parent: Connection, spares) -> tuple[dict, dict | None, dict]:
    """Start the ranks (spares first, forks for the others), wait until each one has sent its result or is gone,
    stop them all at the first failure or cancel, and once they have all returned.

    Returns the report, the next request if one arrived meanwhile (a new job), and the workers to reap once the
    report is sent: those of a job that used spares and went well (else the ranks are reaped before the report)."""
    # Rendezvous through a file that only this job knows: no TCP port to pick, so two launches at the same
    # time (two notebooks, parallel tests) can never meet each other's ranks. Gloo itself binds to loopback.
    job["rendezvous"] = os.path.join(tempfile.gettempdir(), f"{RENDEZVOUS_PREFIX}{os.getpid()}-{job['id']}")
    world_size, spec = job["world_size"], _spec(job)
    ranks: dict = {}  # rank -> Worker
    messages, exited, first_failure, cancelled, next_request, went_well = {}, set(), None, False, None, False
    try:
        use_spares = job.get("spares", 0) > 0 and spares.ready and len(job["fn"]) < workers.PIPE_BYTES
        job_bytes = pickle.dumps(job) if use_spares else b""
        for spare in spares.take(spec, world_size if use_spares else 0, len(job_bytes)):
            rank = spare.slot  # the rank it was prepared as (under NCCL its GPU's CUDA context is made already)
            if rank < world_size and rank not in ranks and spare.start(rank, job_bytes):
                ranks[rank] = spare
            else:  # it died meanwhile (or fits no rank): a fork takes its rank
                spares.retire(spare)
        for rank in range(world_size):
            if rank not in ranks:
                close = [parent.fileno(), *spares.fds(), *(fd for worker in ranks.values() for fd in worker.fds())]
                ranks[rank] = workers.Worker(spec, None, close, job=(rank, job))
        rank_of = {worker.out: rank for rank, worker in ranks.items()}
        boards = [ranks[rank].board for rank in range(world_size)]

        last_calls, last_look, last_sent = None, 0.0, 0.0
        while len(exited | messages.keys()) < world_size:  # a rank is done once it sent its result, or is gone
            waiting = [worker.out for rank, worker in ranks.items() if rank not in exited and rank not in messages]
            ready = wait([parent, *waiting], timeout=CALLS_EVERY)
            if time.monotonic() - last_look >= CALLS_EVERY:
                last_look = time.monotonic()
                calls = _read_slots(boards)
                if calls != last_calls or last_look - last_sent >= CALLS_RESEND:
                    parent.send_bytes(pickle.dumps({"job_id": job["id"], "calls": calls, "at": last_look}))
                    last_calls, last_sent = calls, last_look
            if parent in ready:
                request = pickle.loads(parent.recv_bytes())  # EOFError if the parent died: main() exits
                if "bye" in request:  # the parent shuts the server down while this job runs: stop it, then exit
                    cancelled = True
                    _kill(ranks)
                    raise _Bye
                if "job" in request:  # the parent gave up on this job (interrupted) and wants the next one
                    next_request, cancelled = request, True
                    _kill(ranks)
                elif request.get("cancel") == job["id"]:
                    cancelled = True
                    _kill(ranks)
                elif "cancel" in request:  # for a job that has already ended
                    parent.send_bytes(pickle.dumps({"job_id": request["cancel"], "report": None}))
            for conn in ready:
                if conn is parent:
                    continue
                rank = rank_of[conn]
                try:
                    message = pickle.loads(conn.recv_bytes())
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
                    silent = _silent_death(ranks, messages, exited) if rank in messages else None
                    first_failure = _culprit(silent, rank, messages)
                    _kill(ranks)  # stop the other ranks at once: they would only hang on the dead peer
        went_well = first_failure is None and not cancelled and all(m["ok"] for m in messages.values())
    finally:
        # Every exit path: stop the ranks (those that returned wait for this: they leave together) and what they
        # started (their process groups exist until they are reaped), and remove the rendezvous file (killed
        # ranks cannot). A job of spares that went well is reaped after its report: its ranks are already killed.
        _kill(ranks)
        _remove(job["rendezvous"])
        later = went_well and job.get("spares", 0) > 0
        exit_codes, stderr_tails = ({}, {}) if later else _reap(ranks, spares)
    report = {
        "messages": messages,
        "first_failure": first_failure,
        "cancelled": cancelled,
        "exit_codes": exit_codes,
        "stderr_tails": stderr_tails,
        "spares": sum(worker.fingerprint is not None for worker in ranks.values()),  # ranks served by spares
    }
    return report, next_request, ranks if later else {}


def _spec(job: dict) -> dict:
    """What a worker is set up for before it knows its rank ("cuda": an NCCL job, one GPU per rank)."""
    return {**{key: job[key] for key in ("env", "sys_path", "cwd", "slot_bytes")}, "cuda": job["backend"] == "nccl"}


def _kill(ranks: dict) -> None:
    for worker in ranks.values():
        worker.kill()


def _reap(ranks: dict, spares) -> tuple[dict, dict]:
    """Wait for the killed ranks' exits, stop what their code started elsewhere, pass their stderr on.
    Returns each rank's exit code and the last lines each one wrote to its stderr."""
    exit_codes = {rank: worker.reap() for rank, worker in ranks.items()}
    spares.reap_retired()
    _stop_adopted(keep=spares.pids())  # what the rank code started in sessions of its own, out of reach of killpg
    tails = {rank: _tail_and_pass_on(worker.err) for rank, worker in ranks.items()}
    return exit_codes, {rank: tail for rank, tail in tails.items() if tail}


def _silent_death(ranks: dict, messages: dict, exited: set, within: float = 0.25) -> int | None:
    """After a rank reported an error: a rank whose process ended without any message within `within` seconds
    (os._exit, a crash, a kill), or None. Messages read meanwhile are kept as the main loop would keep them."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        waiting = {ranks[r].out: r for r in ranks if r not in exited and r not in messages}
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


# How a rank's error reads when all it saw was a peer's process going away (gloo's words).
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _culprit(silent: int | None, rank: int, messages: dict) -> int:
    """The rank to blame, once `rank` reported an error and the others had a moment to report theirs (see
    _silent_death): one that died without a word, else the first reporter, unless all it saw was a lost peer and
    another rank raised an error of its own meanwhile (both errors can arrive in the same moment, the victim's
    first): then that rank, the lowest of them."""
    if silent is not None:
        return silent

    def lost_peer(message: dict) -> bool:
        lines = message.get("traceback", "").strip().splitlines()
        return bool(lines) and any(words in lines[-1] for words in LOST_PEER)

    if rank not in messages or not lost_peer(messages[rank]):
        return rank
    own = [r for r, m in sorted(messages.items()) if not m["ok"] and not lost_peer(m)]
    return own[0] if own else rank


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


class _Bye(Exception):
    """The parent said bye: it shuts the server down, and removes its scratch folders itself."""


_done = False  # main() has returned: no job is left to clean up


def _terminated(signum, frame) -> None:
    if _done:  # exiting already (atexit, finalizers): an exception raised there would only print "Exception
        os._exit(128 + signum)  # ignored in atexit callback" into the notebook's log
    raise SystemExit(128 + signum)  # through _run_job's finally: its ranks stopped, its rendezvous file removed


def main(fd: int) -> None:
    parent = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the kernel is handled by the parent, not here
    # A hang-up reaches the terminal's whole process group, this server too: the parent decides (it closes the
    # server, or dies and the server sees it); a SIGTERM sent to the server itself is an orderly exit.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _terminated)
    _become_subreaper()
    _remove_stale_rendezvous_files()
    spares = workers.Spares()
    scratch = []  # the parent's scratch folders, as its latest job listed them
    try:
        parent.send_bytes(
            pickle.dumps({"ready": os.getpid(), "tmp": tempfile.gettempdir()})
        )  # torch is imported: launches are fast from now
        request = None
        while True:
            request = request or pickle.loads(parent.recv_bytes())
            if "bye" in request:
                raise _Bye
            if "cancel" in request:  # its job has already ended (or never arrived): say so
                parent.send_bytes(pickle.dumps({"job_id": request["cancel"], "report": None}))
                request = None
                continue
            job, started = request["job"], time.perf_counter()
            scratch = job.get("scratch", [])
            report, request, unreaped = _run_job(job, parent, spares)
            report["server_seconds"] = time.perf_counter() - started
            parent.send_bytes(pickle.dumps({"job_id": job["id"], "report": report}))
            del report  # keep nothing of a finished job: its results can be large
            # Off the launch's critical path, while the parent goes on: reap, then prepare the next job's ranks.
            if unreaped:
                _reap(unreaped, spares)
            spares.reap_retired()
            if request is None:
                wanted = job.get("spares", 0) and job["world_size"]
                spares.top_up(_spec(job), wanted, lambda: [parent.fileno()], busy=lambda: parent.poll(0))
            del job
    except _Bye:
        pass  # _run_job has killed the ranks on its way out; the spares die with the server
    except (EOFError, OSError, KeyboardInterrupt):
        # The parent went away without a word (killed): _run_job has killed the ranks on its way out, and what the
        # parent would have removed at its exit is removed here (the spares die with the server).
        _remove_scratch(scratch)
    finally:
        global _done
        _done = True


if __name__ == "__main__":
    main(int(sys.argv[1]))
