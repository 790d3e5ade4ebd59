"""The grader: each submission in a fresh kernel, a scratch folder and a sandbox, its checks judged here (see
parlab/grading/command.py's docstring for the whole procedure, and `python -m parlab grade`)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from parlab.grading.markers import answer_name, check_marker, prediction_name, prediction_problem
from parlab.grading.official import (
    DEFAULT_TIMEOUT,
    GRACE,
    MAX_DATA_BYTES,
    MAX_NOTEBOOK_BYTES,
    PACKAGE,
    WARM_UP,
    OfficialLab,
    identify,
    lab_of_file_name,
    read_regular_file,
)
from parlab.grading.scores import CheckResult, NotebookGrade, assemble, score_lines

# What the processes of a submission import (the worker, its kernel, the rank server and ranks, the labs), put once
# into the run's bytecode cache (Grader.shared_pycache, a folder given as argv[1]) before any student code runs. The
# script itself reads the usual .pyc files (it runs without a prefix): each module it imported gets, in the cache, a
# copy of the .pyc Python loaded it from (pip and Python wrote those at install; a copy is valid wherever it lies,
# since its header holds its source's time and size), or, for parlab's own modules and any module without one, a .pyc
# compiled here from the source. (Compiling everything from source instead cost ~14 s of CPU per grading run.)
WARM_PYCACHE = """
import importlib, importlib.util, os, pkgutil, py_compile, shutil, sys
import cloudpickle, ipykernel.kernelapp, jupyter_client, nbclient, nbformat, torch, torch._dynamo
import parlab
for module in pkgutil.walk_packages(parlab.__path__, "parlab."):
    if not module.name.endswith("__main__"):  # (that one runs the command line)
        try:
            importlib.import_module(module.name)
        except BaseException:  # a module that needs more than an import: compiled at its first use instead
            pass
package = os.path.dirname(parlab.__file__) + os.sep
for module in list(sys.modules.values()):
    source = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(module, "__file__", None)
    if not source or not source.endswith(".py") or not os.path.isfile(source):
        continue
    installed = importlib.util.cache_from_source(source)  # the usual __pycache__ file
    sys.pycache_prefix = sys.argv[1]
    target = importlib.util.cache_from_source(source)  # where a process with the prefix looks
    sys.pycache_prefix = None
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if not source.startswith(package) and os.path.isfile(installed):
        shutil.copyfile(installed, target)
    else:  # parlab's own modules always from their source: never a .pyc that lay beside the package
        py_compile.compile(source, cfile=target, doraise=False)
"""


class Grader:
    """Grades submissions one after the other (or a few at once), each isolated from the grader and the others."""

    def __init__(self, labs: dict[str, OfficialLab], timeout: float, sandbox, guard):
        self.labs, self.timeout, self.sandbox, self.guard = labs, timeout, sandbox, guard
        self.running: set[int] = set()  # the worker pids being graded now (kill_tree spares the others)
        self.lock = threading.Lock()
        self.failed = False  # the grader itself failed on some submission
        self._pycache: Path | None = None
        self._pycache_digests: dict[str, str] = {}  # file of the shared cache -> sha256, as the warm-up wrote it
        self._pycache_lock = threading.Lock()

    def shared_pycache(self) -> Path:
        """The bytecode cache every submission reads: read-only in the sandbox, a checked copy without one.

        A submission's Python never reads or writes the .pyc files beside the package (PYTHONPYCACHEPREFIX points
        elsewhere): one that planted a .pyc there could change what the next submission runs. A cache of its own per
        submission would be safe but empty, and then every process it starts compiles torch and parlab from source
        (~2.5 s of CPU per interpreter: the kernel, its rank server). So the grader fills one cache itself, before
        any student code runs, and the sandbox shows it read-only: no submission can change it. Without a sandbox
        a submission could write into it, so there each gets a copy of its own, of the files as they were written
        (see _own_pycache)."""
        with self._pycache_lock:
            if self._pycache is None:
                cache = Path(tempfile.mkdtemp(prefix="parlab-grade-pycache-"))
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
                env.update(
                    PYTHONDONTWRITEBYTECODE="1",  # nothing written beside the packages: only into the cache
                    PYTHONPATH=str(PACKAGE.parent),
                    PARLAB_WARM="0",
                    PYTHONWARNINGS="ignore",
                )
                command = [sys.executable, "-c", WARM_PYCACHE, str(cache)]
                subprocess.run(command, env=env, cwd=cache, capture_output=True, timeout=600)
                # (whatever it could not put there is compiled, in memory, where it is used)
                if self.sandbox.kind == "none":  # what each copy is checked against (see _own_pycache)
                    self._pycache_digests = {
                        str(path.relative_to(cache)): hashlib.sha256(path.read_bytes()).hexdigest()
                        for path in cache.rglob("*.pyc")
                    }
                self._pycache = cache
            return self._pycache

    def _own_pycache(self, scratch: Path) -> Path:
        """The bytecode cache of one submission: the shared one itself in a sandbox (read-only there), a copy of it in
        the submission's scratch folder without one (~70 MB; an empty cache instead cost ~15 s of CPU per
        submission, its kernel and rank server compiling torch from source)."""
        shared = self.shared_pycache()
        if self.sandbox.kind != "none":
            return shared
        # Without a sandbox an earlier submission could have written into the shared cache: only the files the
        # warm-up wrote are copied, and only while their bytes are still those it wrote (any other is compiled
        # from source where it is used), so nothing one submission planted there reaches another.
        own = scratch / "pycache"
        for name, digest in self._pycache_digests.items():
            try:
                data = (shared / name).read_bytes()
            except OSError:
                continue
            if hashlib.sha256(data).hexdigest() == digest:
                (own / name).parent.mkdir(parents=True, exist_ok=True)
                (own / name).write_bytes(data)
        return own

    def close(self) -> None:
        """Remove the run's bytecode cache."""
        if self._pycache is not None:
            shutil.rmtree(self._pycache, ignore_errors=True)
            self._pycache = None

    def _running_now(self) -> set[int]:
        with self.lock:
            return set(self.running)

    # --------------------------------------------------------------------------------------------- one notebook

    def grade(self, path: str | Path, expected_lab: str | None = None) -> NotebookGrade:
        started = time.monotonic()
        try:
            grade = self._grade(Path(path), expected_lab)
        except Exception as exc:  # a bug of the grader's: this notebook gets an error, the run goes on
            self.failed = True
            grade = NotebookGrade(str(path), expected_lab or "?", error=f"grader error: {type(exc).__name__}: {exc}")
        grade.seconds = time.monotonic() - started
        return grade

    def _grade(self, path: Path, expected_lab: str | None) -> NotebookGrade:
        import nbformat

        expected_lab = expected_lab or lab_of_file_name(path, self.labs)
        try:
            submission = nbformat.reads(read_regular_file(path, MAX_NOTEBOOK_BYTES), as_version=4)
            if not isinstance(submission.get("cells"), list):
                raise ValueError("no cells")
            actual, notes = identify(submission, self.labs)
        except Exception as exc:  # unreadable: 0 of the lab's maximum when we know which lab it was meant to be
            grade = NotebookGrade(
                str(path), expected_lab or "?", error=f"unreadable notebook: {type(exc).__name__}: {exc}"
            )
            return grade.fail_all(self.labs[expected_lab], "unreadable notebook") if expected_lab else grade
        if expected_lab and actual and actual != expected_lab:
            grade = NotebookGrade(str(path), expected_lab, notes=notes)
            grade.error = f"wrong lab: this notebook is {actual}, not {expected_lab}"
            return grade.fail_all(self.labs[expected_lab], f"the notebook is {actual}")
        lab_name = expected_lab or actual
        if lab_name is None:
            return NotebookGrade(str(path), "?", notes=notes, error="not a lab: no official lab has its answer cells")
        lab = self.labs[lab_name]
        nb, more = assemble(submission, lab)
        grade = NotebookGrade(str(path), lab_name, notes=notes + more)
        self._execute_and_judge(nb, lab, grade)
        return grade

    # -------------------------------------------------------------------------------- execution, isolated

    def _execute_and_judge(self, nb, lab: OfficialLab, grade: NotebookGrade) -> None:
        import nbformat

        from parlab.grading.isolation import kill_tree, remove_scratch
        from parlab.grading.labs import OUT_ENV

        scratch = Path(tempfile.mkdtemp(prefix="parlab-grade-"))
        try:
            for sub in ("out", "home", "tmp", "pycache"):
                (scratch / sub).mkdir()
            nb = copy.deepcopy(nb)
            first = next((i for i, c in enumerate(nb.cells) if check_marker(c)), len(nb.cells))
            nb.cells.insert(first, nbformat.v4.new_code_cell(WARM_UP))
            nbformat.write(nb, scratch / "assembled.ipynb")
            code_cells = [c for c in nb.cells if c.cell_type == "code"]
            setup_timeout = max(self.timeout, DEFAULT_TIMEOUT)
            cells = {}
            for index, cell in enumerate(nb.cells):
                if answer_name(cell):
                    cells[str(index)] = ["answer", answer_name(cell)]
                elif check_marker(cell):
                    cells[str(index)] = ["check", check_marker(cell)[0]]
            spec = {"timeout": self.timeout, "setup_timeout": setup_timeout, "grace": GRACE, "cells": cells}
            (scratch / "spec.json").write_text(json.dumps(spec))
            limit = 60 + sum(
                (self.timeout if answer_name(c) or check_marker(c) else setup_timeout) + GRACE for c in code_cells
            )
            pycache = self._own_pycache(scratch)
            token = secrets.token_hex(8)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PARLAB_GRADE", "JPY_", "PYTEST_"))}
            env.update(
                {
                    OUT_ENV: str(scratch / "out"),
                    "PARLAB_GRADE_TOKEN": token,
                    "HOME": str(scratch / "home"),
                    "IPYTHONDIR": str(scratch / "home" / ".ipython"),
                    "JUPYTER_RUNTIME_DIR": str(scratch / "home" / "runtime"),
                    "JUPYTER_DATA_DIR": str(scratch / "home" / "data"),
                    "MPLCONFIGDIR": str(scratch / "home" / "mpl"),
                    "TMPDIR": str(scratch / "tmp"),
                    # never the package's own .pyc (see shared_pycache): the run's shared cache, read-only in the
                    # sandbox; without one, a copy of the submission's own
                    "PYTHONPYCACHEPREFIX": str(pycache),
                    "PYTHONPATH": str(PACKAGE.parent),  # the kernel imports this parlab, the one being guarded
                    "PYTHONWARNINGS": "ignore",
                }
            )
            worker = [sys.executable, str(PACKAGE / "grading" / "worker.py"), str(scratch)]
            visible = [PACKAGE.parent, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent]
            visible += [pycache]
            command = self.sandbox.wrap(worker, scratch, visible)
            with open(scratch / "worker.log", "ab") as log, self.lock:  # started and registered at once
                process = subprocess.Popen(
                    command,
                    env=env,
                    cwd=scratch,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
                self.running.add(process.pid)
            hard_timeout = False
            try:
                process.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                hard_timeout = True
            with self.lock:
                self.running.discard(process.pid)
            kill_tree(process, token, self._running_now)
            if hard_timeout:
                grade.notes.append(f"stopped after the grader's hard limit of {limit:g} s")
            with self.lock:
                changed = self.guard.changes()
                names = [self.guard.relative(p) for p in changed]
                shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
                if changed and self.sandbox.kind == "none":
                    self.guard.restore(changed)
                    grade.tampered = names
                    grade.notes.append(
                        f"TAMPERING: changed files of the package or the labs (restored; scores 0): {shown}"
                    )
                elif changed:  # the sandbox kept the submission from writing there: someone else changed them
                    self.guard.accept()
                    grade.notes.append(f"files changed during grading, not by this (sandboxed) submission: {shown}")
            own_numbers = {
                name: problem
                for cell in nb.cells
                if (name := prediction_name(cell)) and (problem := prediction_problem(cell.source))
            }
            self._judge(lab, scratch, grade, own_numbers)
        finally:
            if os.environ.get("PARLAB_GRADE_KEEP"):  # debugging the grader: keep the worker's log and status
                grade.notes.append(f"scratch folder kept: {scratch}")
            else:
                remove_scratch(scratch)

    def _judge(self, lab: OfficialLab, scratch: Path, grade: NotebookGrade, own_numbers: dict | None = None) -> None:
        """Score every check from the data its cell saved, judged here; explain every check without data.
        own_numbers: {prediction: why its cell is not the student's own arithmetic}, each a FAIL of its check."""
        own_numbers = own_numbers or {}
        import torch

        from parlab.grading.labs import judge

        cells = _read_status(scratch / "status.json")
        log = _read_log(scratch / "worker.log")
        by_name = {(c.get("kind"), c.get("name")): c for c in cells}
        grade.timings = [[str(c.get("kind")), str(c.get("name")), c.get("seconds")] for c in cells if "seconds" in c]
        dead = ""
        untouched = any(c.get("kind") == "answer" and _untouched(str(c.get("error") or "")) for c in cells)
        for cell in cells:
            if cell.get("kind") == "answer" and not cell.get("skipped"):
                name = cell.get("name")
                if cell.get("killed"):
                    grade.notes.append(f"answer cell {name!r} ignored the interrupt after {self.timeout:g} s: killed")
                elif cell.get("timed_out"):
                    grade.notes.append(f"answer cell {name!r} timed out after {self.timeout:g} s (interrupted)")
                elif cell.get("error") and _untouched(cell["error"]):
                    grade.notes.append(f"answer cell {name!r} not attempted (it still raises NotImplementedError)")
                elif cell.get("error"):
                    grade.notes.append(f"answer cell {name!r} raised {_short(cell['error'])}")
            dead = dead or cell.get("dead") or ""
        if dead:
            grade.notes.append(dead)
        for name, points in lab.checks:
            cell = by_name.get(("check", name))
            data_path = scratch / "out" / f"{name}.pt"
            reason = _missing_reason(cell, self.timeout, log, dead)
            if untouched and reason.startswith("NameError"):  # the name an untouched answer cell was to define
                reason = f"not attempted: {reason} (an answer cell still raises NotImplementedError)"
            if cell is None or cell.get("skipped") or not data_path.is_file():
                grade.checks.append(CheckResult(name, False, 0, points, reason))
                continue
            try:
                if data_path.stat().st_size > MAX_DATA_BYTES:
                    raise ValueError(f"the check's data is larger than {MAX_DATA_BYTES >> 20} MB")
                data = torch.load(data_path, weights_only=True, map_location="cpu")  # data only: no code runs
                lines = judge(lab.module, name, data, graded=True)  # the feedback may show the numbers
                if name in own_numbers:
                    lines = [*lines, f"{name}: the prediction is your own number: {own_numbers[name]}: FAIL"]
            except Exception as exc:
                detail = f"the check's data is malformed ({type(exc).__name__}: {str(exc)[:120]})"
                grade.checks.append(CheckResult(name, False, 0, points, detail))
                continue
            result = score_lines(name, points, lines, lab.expected[name])
            if not result.passed and isinstance(data, dict) and isinstance(data.get("error"), str):
                error = data["error"]
                result.detail = NOT_ATTEMPTED if _untouched(error) else _with_log_line(error, cell, log)
            grade.checks.append(result)


NOT_ATTEMPTED = "not attempted: the answer still raises NotImplementedError (the handout's stub)"


def _untouched(error: str) -> bool:
    """An error that is the handout's stub itself: the part was not attempted."""
    return "NotImplementedError" in error


def _short(text: str) -> str:
    from parlab.grading.labs import informative_line

    first = text.strip().splitlines()[0] if text.strip() else ""
    return (informative_line(text) or first)[:240]


def _read_status(path: Path) -> list[dict]:
    """The worker's account of each cell, as data; anything malformed is dropped."""
    try:
        if path.stat().st_size > 10 * 2**20:
            return []
        status = json.loads(path.read_text())
        cells = status.get("cells", []) if isinstance(status, dict) else []
        return [c for c in cells if isinstance(c, dict)]
    except (OSError, ValueError):
        return []


def _read_log(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(20 * 2**20)
    except OSError:
        return b""


def _log_slice(cell: dict | None, log: bytes) -> str:
    span = cell.get("log") if cell else None
    if not (isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span)):
        return ""
    return log[span[0] : span[1]].decode("utf-8", "replace")


def _with_log_line(error: str, cell: dict | None, log: bytes) -> str:
    """An error, plus the informative line its rank wrote to stderr when the error itself has none (a rank that
    died: 'exited with code -6')."""
    from parlab.grading.labs import informative_line

    stderr = _log_slice(cell, log)
    if "exited with code" in error or "before returning a result" in error:
        line = informative_line(stderr)
        return f"{error}: {line}" if line else error
    # The first rank to fail may only have lost its peer ("Connection reset by peer") while another rank's own
    # error, on stderr, names the cause ("Received data size doesn't match"): show that one too.
    cause = informative_line(f"{stderr}\n{error}")
    return f"{error} (on a rank's stderr: {cause})" if cause and cause not in error else error


def _missing_reason(cell: dict | None, timeout: float, log: bytes, dead: str) -> str:
    """Why a check has no data (or failed): what its cell did, in one line."""
    if cell is None:
        return dead or "not run: the process running the notebook ended before this check (killed?)"
    if cell.get("skipped"):
        return str(cell["skipped"])
    if cell.get("killed"):
        return f"ignored the interrupt after {timeout:g} s: the kernel was killed"
    if cell.get("timed_out"):
        return f"timed out after {timeout:g} s (interrupted)"
    if cell.get("error") and _untouched(str(cell["error"])):
        return NOT_ATTEMPTED
    if cell.get("error"):
        return _with_log_line(_short(str(cell["error"])), cell, log)
    return "the check cell saved no data"
