"""Helpers the launch tests share: which processes a process has started (read from /proc)."""

import contextlib
import inspect
import os
import tempfile
import time


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def ranks_of(server_pid: int) -> list[int]:
    """The rank server's children less its spares (processes it prepared for the next launch, named parlab-spare,
    which exist between launches when spares are on: PARLAB_SPARES, parlab/runtime/launcher.py)."""
    ranks = []
    for pid in children_of(server_pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "parlab-spare":
                    continue
        except OSError:  # gone meanwhile
            continue
        ranks.append(pid)
    return ranks


def described(pids: list[int]) -> list[str]:
    """Each process as "PID NAME STATE" (from /proc/PID/stat), for an assertion's message; gone ones left out."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        out.append(f"{pid} {stat[stat.index('(') + 1 : stat.rindex(')')]} {stat.rsplit(')', 1)[1].split()[0]}")
    return out


def wait_until(condition, seconds: float = 10.0) -> bool:
    """Whether `condition` held at some moment within `seconds`. Not asked once more after it held: a spare the
    server forks meanwhile carries the server's name until it names itself, which a second look could catch."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@contextlib.contextmanager
def temp_folder_of_our_own(folder: str):
    """Within: `folder` is the temp dir of this process (TMPDIR and tempfile), of the rank server the next launch
    starts (and so of its ranks: rendezvous files, offload folders) and of the command lines started meanwhile.
    Other pytest-xdist workers use the shared temp dir at the same time: what a test counts there is not its own."""
    from parlab.runtime import server

    old_env, old_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    server.shutdown()  # the next launch starts a server that reads the new TMPDIR
    os.environ["TMPDIR"], tempfile.tempdir = folder, folder
    try:
        yield folder
    finally:
        server.shutdown()
        tempfile.tempdir = old_tempdir
        if old_env is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old_env


# The same, as source for the scripts the tests run in a process of their own: children() of that process.
CHILDREN = (
    "import os\n\n" + inspect.getsource(children_of) + "\n\ndef children():\n    return children_of(os.getpid())\n"
)
