"""A scratch folder that is always removed: where disk offload (parlab/schemes/zero/offload.py) keeps its files.

    with offload_folder() as folder:      # <tempdir>/parlab-offload-<owner pid>-<random>, created
        ...                               # removed after success, an exception or Ctrl-C (finally),
                                          # at interpreter exit if the block never ends (atexit)

The process that owns the run (the parent) owns the folder, so ranks killed by a timeout (SIGKILL: no finally runs
there) leave nothing behind. A folder given by path (`--folder x/deep/a`) goes with every folder that was made to
hold it (x, x/deep: those that did not exist before). Each folder the process owns is listed by `owned()`: every
launch hands that list to the rank server, which removes them if the parent dies without a word (SIGKILL: no
finally, no atexit); the command line turns SIGTERM and SIGHUP into an orderly exit. `sweep_orphans` removes the
folders of owner processes that were killed while no rank server watched.
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
    (atexit), with the folders made to hold it. sweep_orphans() first removes the folders of processes that were
    killed. A folder that exists and holds anything is refused (ValueError): it would be removed with the rest."""
    check_folder(path)
    sweep_orphans(Path(path).parent if path else None)
    path = Path(path) if path else new_folder_path()
    own(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        release(path)


# Every scratch folder this process will remove: its path -> the folders creating it makes (itself first, then the
# parents that did not exist), deepest first.
_owned: dict[str, list[str]] = {}


def own(path: str | Path) -> None:
    """This process removes `path` (a folder not made yet) and the parents made to hold it: at release(path), and at
    exit whatever happened (atexit; the rank server if this process is killed)."""
    key = str(Path(path).absolute())
    if key not in _owned:
        _owned[key] = [str(p) for p in (Path(key), *Path(key).parents) if not p.exists()]


def release(path: str | Path) -> None:
    """Remove an owned folder and whatever it holds, then the parents made for it that are empty now."""
    key = str(Path(path).absolute())
    made = _owned.pop(key, [key])
    shutil.rmtree(key, ignore_errors=True)
    for folder in made[1:]:  # deepest first: an emptied parent, then its own parent
        try:
            os.rmdir(folder)
        except OSError:  # not empty (something else lives there now), or gone already
            break


def owned() -> list[list[str]]:
    """The folders this process will remove, each as [path, parents made for it...] (for the rank server)."""
    return [[key, *made[1:]] for key, made in _owned.items()]


@atexit.register
def _release_all() -> None:
    for key in list(_owned):
        release(key)


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
