"""A scratch folder that is always removed: where disk offload (parlab/offload.py) keeps its files.

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
    """A folder given for the disk files must be new or empty: the run removes it afterwards."""
    if path and Path(path).exists() and (not Path(path).is_dir() or any(Path(path).iterdir())):
        raise ValueError(f"folder {str(path)!r} exists and is not empty: the run removes its folder afterwards; "
                         "give a new one")  # fmt: skip


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
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, and belongs to someone else
        pass
    return True
