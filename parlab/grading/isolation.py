"""What keeps one submission from reaching the grader, the package or the next submission.

- `Sandbox`: bubblewrap (`bwrap`) where it works: the submission's processes see the whole filesystem read-only
  except their scratch folder (and a private /tmp), their own process ids (they cannot see or signal the grader)
  and no network. Where bwrap is missing or cannot create namespaces, `Sandbox.reason` says why and submissions run
  as plain processes (still in their own session, killed as a whole).
- `kill_tree`: SIGKILL for a worker and everything it started, found by parentage, by a token in the environment,
  and by the grader being a child subreaper (orphans of a submission become the grader's children, not init's).
- `TreeGuard`: the bytes of every file under parlab/ and labs/, read before any student code runs; after each
  submission, any change is reported and, where no sandbox stopped the writes, blamed on it (tampering) and undone.
  Inside the sandbox a submission cannot write there, so a change is someone else's (an editor, a `git pull`): it
  is reported, not undone.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36  # from <sys/prctl.h>


# ------------------------------------------------------------------------------------------------ the sandbox


class Sandbox:
    """bubblewrap if it is installed and works here; else nothing (`kind` "none", `reason` why)."""

    def __init__(self, mode: str = "auto"):
        self.kind, self.reason = "none", ""
        if mode == "none":
            self.reason = "turned off (--sandbox none)"
            return
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            self.reason = "bwrap (bubblewrap) is not installed"
        else:
            with tempfile.TemporaryDirectory(prefix="parlab-sandbox-probe-") as scratch:
                try:
                    done = subprocess.run(
                        self._args(bwrap, Path(scratch)) + ["true"], capture_output=True, text=True, timeout=30
                    )
                    if done.returncode == 0:
                        self.kind, self.bwrap = "bwrap", bwrap
                    else:
                        self.reason = f"bwrap does not work here: {done.stderr.strip()[:200]}"
                except (OSError, subprocess.TimeoutExpired) as exc:
                    self.reason = f"bwrap does not work here: {exc}"
        if mode == "bwrap" and self.kind != "bwrap":
            raise RuntimeError(f"--sandbox bwrap: {self.reason}")

    @staticmethod
    def _args(bwrap: str, scratch: Path, visible: list[Path] = ()) -> list[str]:
        args = [
            bwrap,
            "--ro-bind",
            "/",
            "/",  # everything read-only ...
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--tmpfs",
            "/tmp",  # ... a private /tmp ...
        ]
        tmp = Path(tempfile.gettempdir()).resolve()
        for path in sorted({Path(p).resolve() for p in visible}):  # ... in which what must be seen stays visible
            if path == tmp or tmp in path.parents or Path("/tmp") in path.parents:
                args += ["--ro-bind", str(path), str(path)]
        args += [
            "--bind",
            str(scratch),
            str(scratch),  # ... and the scratch folder writable
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--die-with-parent",
            "--new-session",
            "--chdir",
            str(scratch),
            "--",
        ]
        return args

    def wrap(self, command: list[str], scratch: Path, visible: list[Path] = ()) -> list[str]:
        """`command` inside the sandbox; `visible`: folders it must read (the package, the Python environment),
        in case they lie under /tmp, which the sandbox replaces by an empty one."""
        return self._args(self.bwrap, scratch, visible) + command if self.kind == "bwrap" else command

    def describe(self) -> str:
        if self.kind == "bwrap":
            return "bubblewrap: read-only filesystem but the scratch folder, own process ids, no network"
        return f"none ({self.reason}); each submission still runs in its own session, killed as a whole"


# ----------------------------------------------------------------------------------------- processes, killed


def become_subreaper(on: bool = True) -> None:
    """Orphaned descendants (a double fork) become this process's children, where kill_tree finds them."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on))
    except (OSError, AttributeError):
        pass


def _processes() -> dict[int, int]:
    """pid -> parent pid, for every process this one can see."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
            parents[int(entry)] = int(text.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def _has_token(pid: int, token: str) -> bool:
    try:
        return f"PARLAB_GRADE_TOKEN={token}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def kill_tree(process: subprocess.Popen, token: str, spare=lambda: set()) -> int:
    """SIGKILL `process`, every descendant, every process with this submission's token, and orphans adopted by
    the grader (its children but those `spare()` names: the workers of the other submissions being graded, whose
    start must be registered atomically with it). Returns how many processes it killed."""
    killed, me = 0, os.getpid()
    for _ in range(10):
        parents = _processes()
        keep = set(spare()) - {process.pid}  # read after the listing: a worker seen there is in it
        children: dict[int, list[int]] = {}
        for pid, parent in parents.items():
            children.setdefault(parent, []).append(pid)
        roots = [process.pid] + [p for p in children.get(me, []) if p not in keep and p != process.pid]
        targets, stack = set(), [r for r in roots if r in parents]
        while stack:
            pid = stack.pop()
            if pid in targets or pid == me:
                continue
            targets.add(pid)
            stack.extend(children.get(pid, []))
        targets |= {pid for pid in parents if pid != me and pid not in keep and _has_token(pid, token)}
        targets = {pid for pid in targets if not _is_zombie(pid)}
        if not targets:
            break
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        _reap(keep | {process.pid})
        time.sleep(0.05)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    _reap(set(spare()) | {process.pid})
    return killed


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _reap(spare) -> None:
    """Collect the exit status of adopted orphans (not of the workers still being graded)."""
    for pid, parent in _processes().items():
        if parent == os.getpid() and pid not in spare and _is_zombie(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


# ------------------------------------------------------------------------------------- the package, guarded


class TreeGuard:
    """Every file under `roots`, as bytes, read now; `restore()` reports and undoes any change since."""

    def __init__(self, roots: list[Path]):
        self.roots = [Path(r).resolve() for r in roots if Path(r).is_dir()]
        self.files = self._read()

    def _walk(self) -> list[Path]:
        paths = []
        for root in self.roots:
            for folder, dirs, files in os.walk(root, followlinks=False):
                dirs[:] = [d for d in dirs if d != ".ipynb_checkpoints"]
                paths.extend(Path(folder) / name for name in files)
                paths.extend(Path(folder) / d for d in dirs if (Path(folder) / d).is_symlink())
        return paths

    def _read(self) -> dict[Path, bytes]:
        files = {}
        for path in self._walk():
            if path.is_symlink() or not path.is_file():
                continue
            files[path] = path.read_bytes()
        return files

    def _digest(self, path: Path) -> str | None:
        try:
            if path.is_symlink() or not path.is_file():
                return "not a plain file"
            return hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return "unreadable"

    def changes(self) -> list[Path]:
        """The files changed, added or removed since the guard read them."""
        present = set(self._walk())
        changed = [p for p, data in self.files.items() if p not in present or self._digest(p) != _sha(data)]
        return changed + sorted(present - set(self.files))

    def restore(self, changed: list[Path]) -> None:
        """Put each changed file back as it was (added ones removed)."""
        for path in changed:
            if path in self.files:
                _write_back(path, self.files[path])
            else:
                _remove(path)

    def accept(self) -> None:
        """Take the files as they are now as the reference (a change that was not a submission's doing)."""
        self.files = self._read()

    def relative(self, path: Path) -> str:
        for root in self.roots:
            if path == root or root in path.parents:
                return str(Path(root.name) / path.relative_to(root))
        return str(path)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _make_writable(path: Path) -> None:
    for folder in [path.parent, *path.parent.parents][:3]:
        try:
            folder.chmod(folder.stat().st_mode | stat.S_IWUSR | stat.S_IXUSR | stat.S_IRUSR)
        except OSError:
            pass


def _remove(path: Path) -> None:
    _make_writable(path)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def _write_back(path: Path, data: bytes) -> None:
    if path.is_symlink() or path.is_dir():
        _remove(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _make_writable(path)
    if path.exists():
        try:
            path.chmod(0o644)
        except OSError:
            pass
    path.write_bytes(data)


def remove_scratch(scratch: Path) -> None:
    """Remove a submission's scratch folder, whatever permissions its contents were given."""
    for folder, dirs, _files in os.walk(scratch):
        for d in dirs:
            try:
                os.chmod(os.path.join(folder, d), 0o700)
            except OSError:
                pass
    shutil.rmtree(scratch, ignore_errors=True)
