"""A scratch folder that is always removed: where disk offload (parlab/schemes/zero/offload.py) keeps its files.

    with offload_folder() as folder:      # <tempdir>/parlab-offload-<owner pid>-<random>, created
        ...                               # removed after success, an exception or Ctrl-C (finally),
                                          # at interpreter exit if the block never ends (atexit)

The process that owns the run (the parent) owns the folder, so ranks killed by a timeout (SIGKILL: no finally runs
there) leave nothing behind; `sweep_orphans` removes the folders of owner processes that were killed themselves.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FOLDER_PREFIX = "parlab-offload-"  # every disk folder is <tempdir>/parlab-offload-<owner pid>-<random>


def new_folder_path(root: str | Path | None = None) -> Path:
    """A fresh folder name (not created) owned by this process: <root>/parlab-offload-<pid>-<random>."""
    return Path(root or tempfile.gettempdir()) / f"{FOLDER_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextmanager
def offload_folder(path: str | Path | None = None) -> Iterator[Path]:
    """Create the folder (default: a new one under the temp dir), yield it, and remove it on the way out: after
    success, an exception or a KeyboardInterrupt (finally), and at interpreter exit if the block never ends
    (atexit). sweep_orphans() first removes the folders of processes that were killed. A folder that exists and
    holds anything is refused (ValueError): it would be removed with the rest."""
    check_folder(path)
    sweep_orphans(Path(path).parent if path else None)
    path = Path(path) if path else new_folder_path()
    path.mkdir(parents=True, exist_ok=True)
    remove = lambda: shutil.rmtree(path, ignore_errors=True)  # noqa: E731
    atexit.register(remove)
    try:
        yield path
    finally:
        remove()
        atexit.unregister(remove)


def check_folder(path: str | Path | None) -> None:
    """A folder given for the disk files must be new or empty, and one this process can create and write in:
    the run removes it afterwards, and a folder that cannot be written must be refused before any rank starts.
    Nothing is left behind by the check (a folder it had to create to try is removed again)."""
    if not path:
        return
    path = Path(path)
    if path.is_file():
        raise ValueError(f"folder {str(path)!r} is a file, not a folder: give a new or empty folder")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(
            f"folder {str(path)!r} exists and is not empty: the run removes its folder afterwards; give a new one"
        )
    for parent in path.parents:  # the nearest part of the path that exists must be a folder
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"folder {str(path)!r} cannot be created: {str(parent)!r} is a file")
            break
    created = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".parlab-write-test-{os.getpid()}"
        probe.write_bytes(b"parlab")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"folder {str(path)!r} cannot be created or written here: {exc.strerror or exc}") from None
    finally:
        for folder in created:  # deepest first: only what this check made
            try:
                folder.rmdir()
            except OSError:
                pass


def sweep_orphans(root: str | Path | None = None) -> list[Path]:
    """Remove the offload folders whose owner process no longer exists (killed before its cleanup could run)."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*"):
        match = re.fullmatch(rf"{FOLDER_PREFIX}(\d+)-\w+", folder.name)
        if match and not _alive(int(match[1])):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs: a zombie (dead, not yet reaped: where pid 1 does not reap) is dead."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, and belongs to someone else
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # not Linux, or gone meanwhile
        return not Path("/proc").is_dir()  # on Linux it just ended; elsewhere kill(pid, 0) is all we know
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # the state letter follows the command name in (...)
