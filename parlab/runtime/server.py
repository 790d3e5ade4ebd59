"""The rank server, seen from the parent: one process that imported torch once and forks ranks on request.

The server itself is `parlab/runtime/rankserver.py`; this is the parent's handle on it (start, send a job, read
reports, stop). `parlab.launch` uses it; a student need not read it."""

from __future__ import annotations

import atexit
import glob
import os
import pickle
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from parlab.runtime import CANCEL_WAIT, RENDEZVOUS_PREFIX, SERVER_START_TIMEOUT


class _RankServer:
    """Handle on the rank-server process (one per parent process).

    Only two threads of this process touch the socket: one sends what `outbox` holds, one reads every message
    into `inbox`. The launching thread only puts and gets whole messages, so a KeyboardInterrupt, which Python
    raises in the main thread only, can never leave half a message in the socket."""

    def __init__(self, warm: bool = False):
        self.warm = warm  # started by warm_up(): an interrupted launch leaves it running
        ours, theirs = socket.socketpair()
        script = Path(__file__).with_name("rankserver.py")
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
        self.on_wait = None  # see wait_ready
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
        """Wait until the server has imported torch (this start-up is not counted in a launch's timeout); meanwhile
        `on_wait` is called every 0.25 s (the waiting launch's progress line)."""
        while not self.ready.wait(0.25):
            if self.on_wait is not None:
                self.on_wait()
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
        # "bye" first: the server then knows this process is alive and removes its scratch folders itself; an EOF
        # without it means this process died (e.g. SIGKILL), and the server removes them (rankserver.py).
        self.outbox.put(pickle.dumps({"bye": True}))
        self.outbox.put(None)
        self.threads[0].join(timeout=1)
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


def _forget_server_in_child() -> None:
    """A process forked from this one (a DataLoader worker, multiprocessing) must not use, nor at its exit shut
    down, this process's rank server: it shares the socket. It starts its own if it launches."""
    global _server, _server_lock
    _server, _server_lock = None, threading.Lock()


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
