"""The rank server: a long-lived process that has imported torch once and forks ranks on demand.

Why it exists: starting a rank with `torch.multiprocessing.spawn` costs a fresh interpreter that imports torch
(~2 s per rank here), and `spawn` cannot run a function defined in a notebook cell. This server pays the torch
import once; each launch then only forks `world_size` copies of it (a few milliseconds each), and the function
arrives by value (cloudpickle), so notebook functions work.

It runs as a plain script (`python _rankserver.py FD`), not as `parlab._rankserver`: the server must not import
the parlab package, so that every forked rank imports parlab fresh from disk and never runs stale code.

Protocol (one job at a time, over the socket inherited as file descriptor FD, messages pickled by plain pickle):
    server -> parent   {"ready": pid}           once, when torch is imported
    parent -> server   {"job": ...}            start world_size ranks
    parent -> server   "cancel"                 stop the ranks of the current job now
    server -> parent   {"progress": ...}        a rank started, or reported progress (parlab.progress)
    server -> parent   {"messages": ...}        the report: every rank's outcome, sent once the ranks are all gone
"""

import ctypes
import io
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait

import cloudpickle  # noqa: F401  (preloaded: the ranks unpickle the shipped function with it)
import torch
import torch._dynamo  # noqa: F401  (preloaded: the first torch.optim optimizer imports it, ~3 s per rank)
import torch.distributed as dist

PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the server) dies, so no rank is ever orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the server still kills its ranks on every exit path
        pass


def _to_cpu(value):
    """Tensors go back to the parent on the CPU and by value (plain pickle copies the storage bytes)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _run_rank(job: dict, rank: int, out: Connection) -> None:
    """Body of one forked rank: initialise torch.distributed, run the function, send back its value."""
    _die_with_parent()
    world_size = job["world_size"]
    os.environ.update(job["env"])
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GLOO_SOCKET_IFNAME="lo",  # gloo's own sockets on loopback too, not on the machine's network
        NCCL_SOCKET_IFNAME="lo",
        PARLAB_LAUNCHED="1",
    )
    sys.path[:] = job["sys_path"]
    os.chdir(job["cwd"])
    torch.set_num_threads(job["threads"])
    captured = io.StringIO()  # the rank's prints go back to the parent, which shows them in rank order
    sys.stdout = sys.stderr = captured
    try:
        import importlib

        from parlab import comm

        # parlab.progress() in rank code reports through the same pipe. (importlib: the package attribute
        # parlab.launch is the launch function, the module is parlab.launch in sys.modules.)
        importlib.import_module("parlab.launch")._progress_channel = out
        fn, args, kwargs = pickle.loads(job["fn"])
        if job["backend"] == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            job["backend"],
            init_method=f"file://{job['rendezvous']}",
            rank=rank,
            world_size=world_size,
        )
        out.send_bytes(pickle.dumps({"progress": {"rank": rank, "started": True}}))
        comm.reset_trace()
        value = fn(*args, **kwargs)
        message = {"rank": rank, "ok": True, "value": _to_cpu(value), "events": comm.trace_events()}
    except BaseException:
        message = {"rank": rank, "ok": False, "traceback": traceback.format_exc()}
    message["stdout"] = captured.getvalue()
    try:
        payload = pickle.dumps(message)
    except Exception:
        payload = pickle.dumps(
            {"rank": rank, "ok": False, "stdout": message["stdout"], "traceback": traceback.format_exc()}
        )
    out.send_bytes(payload)
    if message["ok"] and dist.is_initialized():
        # Leave together: a rank that tore down early could break a peer's last collective.
        dist.barrier()
        dist.destroy_process_group()
    out.close()
    os._exit(0)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _kill(pids: dict) -> None:
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_job(job: dict, parent: Connection) -> dict:
    """Fork the ranks, wait for each one's message and exit, stop them all at the first failure or cancel."""
    # Rendezvous through a file that only this job knows: no TCP port to pick, so two launches at the same
    # time (two notebooks, parallel tests) can never meet each other's ranks. Gloo itself binds to loopback.
    job["rendezvous"] = os.path.join(tempfile.gettempdir(), f"parlab-rendezvous-{os.getpid()}-{job['id']}")
    _remove(job["rendezvous"])
    pids, pipes = {}, {}
    for rank in range(job["world_size"]):
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank
            os.close(reader)
            for other in pipes.values():
                other.close()
            parent.close()
            _run_rank(job, rank, Connection(writer, readable=False))
        os.close(writer)
        pids[rank], pipes[rank] = pid, Connection(reader, writable=False)

    messages, exited, first_failure, cancelled = {}, set(), None, False
    while len(exited) < len(pids):
        ready = wait([parent, *[pipes[r] for r in pids if r not in exited]])
        if parent in ready:
            request = parent.recv_bytes()  # EOFError if the parent died: the finally in main() cleans up
            if pickle.loads(request) == "cancel":
                cancelled = True
                _kill(pids)
            continue
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
                first_failure = rank
                _kill(pids)  # stop the other ranks at once: they would only hang on the dead peer
    for pipe in pipes.values():
        pipe.close()
    exit_codes = {}
    for rank, pid in pids.items():
        _, status = os.waitpid(pid, 0)
        exit_codes[rank] = os.waitstatus_to_exitcode(status)
    _remove(job["rendezvous"])  # ranks that were killed could not remove it themselves
    return {
        "messages": messages,
        "first_failure": first_failure,
        "cancelled": cancelled,
        "exit_codes": exit_codes,
    }


def main(fd: int) -> None:
    parent = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the kernel is handled by the parent, not here
    try:
        parent.send_bytes(pickle.dumps({"ready": os.getpid()}))  # torch is imported: launches are fast from now
        while True:
            request = pickle.loads(parent.recv_bytes())
            if request == "cancel":  # arrived just after its job had ended: nothing left to stop
                continue
            started = time.perf_counter()
            report = _run_job(request["job"], parent)
            report["job_id"] = request["job"]["id"]
            report["server_seconds"] = time.perf_counter() - started
            parent.send_bytes(pickle.dumps(report))
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the parent went away: exiting kills every rank (PR_SET_PDEATHSIG)


if __name__ == "__main__":
    main(int(sys.argv[1]))
