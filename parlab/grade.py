"""Grade lab notebooks: `python -m parlab grade NOTEBOOK... [--json] [--report FILE]`.

A lab (labs/solutions/labNN_*.ipynb) has three kinds of cells, marked by their first line:

    # ANSWER: name                    the student writes code here; the solution's code sits between
                                       `# BEGIN SOLUTION: hint` and `# END SOLUTION` lines
    # CHECK: name (N points)          `checks.run("name", answer, ...)`: runs the student's code on live ranks
                                       (the lab's module in parlab/grading/ collects and judges; see there)
    anything else                      explanation, setup, helpers: the same for everyone

The student version (labs/labNN_*.ipynb) is generated from the solution by `student_version` (see
labs/make_labs.py): each solution block becomes `raise NotImplementedError("hint")`, every stored output is kept,
so the stored outputs of the check cells are the expected verdicts and `pytest --nbval` on a completed notebook
passes exactly when the student's code is right.

Grading never trusts a submission, nor anything that ran next to its code:

1. Before any student code runs, the grader reads the official labs by name from the fixed list
   `parlab.grading.LABS` (never a path taken from a submission), their expected verdict lines (the solutions'
   stored outputs), imports their check modules, and reads every file under parlab/ and labs/ (TreeGuard).
2. A submission's lab is the name in its metadata if that name is on the list, else the lab whose answer cells it
   has; the lab expected of it is `--lab`, else its file name's `labNN` prefix. A mismatch scores 0 of the
   expected lab, with a note naming the lab it is.
3. Its ANSWER cells go into a fresh copy of the official lab (nothing else of it is used), which a worker process
   (parlab/grading/worker.py) executes in a new kernel, in a scratch folder, in its own session, inside a
   bubblewrap sandbox where available, under a hard wall-clock limit; then the worker, the kernel, the ranks and
   anything they started are killed (parlab/grading/isolation.py).
4. Each check cell saved its data (tensors, numbers, strings) in the scratch folder; the grader reads it with
   `torch.load(weights_only=True)` and judges it itself with the lab module's `judge_<check>`: a check passes when
   its verdict lines all PASS and equal the solution's (max |err| digits masked, as tests/sanitize.cfg does).
5. Any file under parlab/ or labs/ that changed during the submission is reported as tampering (the submission
   scores 0) and restored before the next one.

Whatever a submission does, the run ends with a table (and `--json` / `--report`); the exit status is 0 unless
the grader itself failed (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from parlab.grading.worker import kernel_manager  # noqa: F401  (labs/make_labs.py executes the solutions with it)

# The masks of tests/sanitize.cfg (tests/test_labs.py checks that they agree).
MASKS = [
    (re.compile(r"max \|err\| [0-9.]+e[-+][0-9]+"), "max |err| ERR"),
    (re.compile(r"at 0x[0-9a-f]+"), "at 0xADDRESS"),
]

ANSWER_RE = re.compile(r"^#\s*(?:ANSWER|PREDICT):\s*(?P<name>\S+)\s*$")  # a prediction is an answer too
CHECK_RE = re.compile(r"^#\s*CHECK:\s*(?P<name>\S+)\s*\((?P<points>\d+)\s*points?\)\s*$")
BEGIN_RE = re.compile(r"^(?P<indent>\s*)#\s*BEGIN SOLUTION(?::\s*(?P<hint>.*?))?\s*$")
END_RE = re.compile(r"^\s*#\s*END SOLUTION\s*$")
HANDOUT_RE = re.compile(r"^\s*#\s*HANDOUT\s*$")  # in a solution block: what follows (commented) is handed out
VERDICT_RE = re.compile(r": (PASS|FAIL)$")
HINT_WIDTH = 100  # the student version's hint lines stay within this many characters

DEFAULT_TIMEOUT = 120  # seconds per answer or check cell; the labs' own launches stop a hang sooner (60 s)


GRACE = 5  # seconds between the interrupt of a cell past its timeout and the kill of its kernel
# A cell the grader adds before the first check cell: the rank server starts (imports torch) under the setup
# cells' timeout, not in the first check's (and not at all for a notebook killed in an answer cell).
WARM_UP = "import parlab\n\nparlab.launch(int, 1, echo=False)"
MAX_NOTEBOOK_BYTES = 20 * 2**20  # a submission larger than this is not read
MAX_DATA_BYTES = 200 * 2**20  # nor a check's data file larger than this
PACKAGE = Path(__file__).resolve().parent  # parlab/
LABS_DIR = PACKAGE.parent / "labs"


def repo_solutions() -> Path:
    """labs/solutions next to the parlab package (an editable install or a checkout)."""
    return LABS_DIR / "solutions"


# ----------------------------------------------------------------------------------------- reading the markers


def _first_line(cell) -> str:
    return cell.source.lstrip("\n").split("\n", 1)[0].strip() if cell.cell_type == "code" else ""


def answer_name(cell) -> str | None:
    """The name of an ANSWER cell (from its first line, else from its metadata), or None."""
    match = ANSWER_RE.match(_first_line(cell))
    if match:
        return match["name"]
    return cell.get("metadata", {}).get("parlab", {}).get("answer") if cell.cell_type == "code" else None


def check_marker(cell) -> tuple[str, int] | None:
    """(name, points) of a CHECK cell, or None."""
    match = CHECK_RE.match(_first_line(cell))
    return (match["name"], int(match["points"])) if match else None


# ------------------------------------------------------------------------------------- the student version


def strip_solution(source: str) -> str:
    """Replace every `# BEGIN SOLUTION: hint` ... `# END SOLUTION` block by `raise NotImplementedError("hint")`.

    A block with a `# HANDOUT` line (the bug hunt) is replaced by what follows that line instead, uncommented: the
    solution keeps the broken code as comments, the student gets it as code, under a line naming the hint."""
    out, inside, handout = [], False, None
    for number, line in enumerate(source.split("\n"), start=1):
        begin, end = BEGIN_RE.match(line), END_RE.match(line)
        if begin:
            if inside:
                raise ValueError(f"line {number}: BEGIN SOLUTION inside another solution block")
            inside, handout = True, None
            indent, hint = begin["indent"], begin["hint"] or ""
        elif inside and HANDOUT_RE.match(line):
            if handout is not None:
                raise ValueError(f"line {number}: two HANDOUT lines in one solution block")
            handout = []
        elif end:
            if not inside:
                raise ValueError(f"line {number}: END SOLUTION without BEGIN SOLUTION")
            inside = False
            out.extend(_handed_out(indent, hint, handout))
        elif inside and handout is not None:
            handout.append(line)
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("BEGIN SOLUTION without END SOLUTION")
    return "\n".join(out)


def _handed_out(indent: str, hint: str, handout: list[str] | None) -> list[str]:
    """What a solution block becomes in the student version."""
    if handout is not None:  # the broken code, uncommented, under the hint as a comment
        width = HINT_WIDTH - len(indent) - 2
        lines = [f"{indent}# {piece}" for piece in textwrap.wrap(hint, width)] if hint else []
        for line in handout:
            body = line[len(indent) :] if line.startswith(indent) else line.lstrip()
            if not body.startswith("#"):
                raise ValueError(f"a HANDOUT line must be commented out in the solution: {line.strip()!r}")
            lines.append(indent + body[2:] if body.startswith("# ") else indent + body[1:])
        return lines
    hint = hint or "write this part"
    lines = [f"{indent}# YOUR CODE HERE"]
    if len(indent) + len(hint) <= HINT_WIDTH - 30:
        lines.append(f"{indent}raise NotImplementedError({json.dumps(hint)})")
    else:  # a long hint: one string in pieces, one per line, short enough for a projector
        pieces = textwrap.wrap(hint, HINT_WIDTH - len(indent) - 6, drop_whitespace=False)
        lines.append(f"{indent}raise NotImplementedError(")
        lines.extend(f"{indent}    {json.dumps(piece)}" for piece in pieces)
        lines.append(f"{indent})")
    return lines


def hint_of(cell) -> str | None:
    """The check a hint cell explains (a markdown cell with metadata parlab.hint), or None."""
    meta = cell.get("metadata", {}).get("parlab", {})
    hint = meta.get("hint") if isinstance(meta, dict) and cell.cell_type == "markdown" else None
    return hint if isinstance(hint, str) else None


def student_version(solution, hints: bool = True):
    """The notebook handed to students: solution blocks stripped and no stored output (no verdict shows before the
    student's own run; the expected verdicts stay in the solution, where the grader reads them). With
    `hints=False` the hint cells (markdown cells with metadata parlab.hint) are left out too."""
    nb = copy.deepcopy(solution)
    if not hints:
        nb.cells = [cell for cell in nb.cells if hint_of(cell) is None]
    answers = set()
    for index, cell in enumerate(nb.cells):
        has_solution = cell.cell_type == "code" and "BEGIN SOLUTION" in cell.source
        name = answer_name(cell)
        if has_solution and name is None:
            raise ValueError(f"cell {index} has a solution block but is not an '# ANSWER: name' cell")
        if name is not None:
            if not has_solution:
                raise ValueError(f"answer cell {name!r} has no BEGIN SOLUTION block")
            if name in answers:
                raise ValueError(f"two answer cells are named {name!r}")
            answers.add(name)
            cell.source = strip_solution(cell.source)
        cell.metadata.pop("execution", None)  # timestamps: the generated file must not change from run to run
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    if not answers:
        raise ValueError("the notebook has no '# ANSWER: name' cell")
    if not any(check_marker(c) for c in nb.cells):
        raise ValueError("the notebook has no '# CHECK: name (N points)' cell")
    return nb


# ----------------------------------------------------------------------------------------- the official labs


@dataclass
class OfficialLab:
    """One lab as the grader knows it, read before any student code runs."""

    name: str
    solution: object  # the solution notebook
    handout: object  # its student version: what a submission's answers are put into
    checks: list[tuple[str, int]]  # (name, points), in order
    answers: set[str]
    expected: dict[str, list[str]]  # the solution's verdict lines per check
    module: object  # parlab.grading.<name>: collect_/judge_ per check
    hints: dict[str, str] = field(default_factory=dict)  # the hint cells' text per check (for the feedback)

    @property
    def max_points(self) -> int:
        return sum(points for _, points in self.checks)


def load_labs(solutions: str | Path | None = None) -> dict[str, OfficialLab]:
    """The official labs found in `solutions` (default labs/solutions), by name from parlab.grading.LABS."""
    import nbformat

    from parlab import grading

    folder = Path(solutions) if solutions is not None else repo_solutions()
    labs = {}
    for name in grading.LABS:
        path = folder / f"{name}.ipynb"  # `name` comes from the fixed list, never from a submission
        if not path.is_file():
            continue
        try:
            labs[name] = _official_lab(name, nbformat.read(path, as_version=4))
        except Exception as exc:  # one broken lab must not stop the grading of the others: say it, loudly
            print(f"parlab grade: warning: lab {name} cannot be graded: {type(exc).__name__}: {exc}", file=sys.stderr)
    if not labs:
        raise ValueError(f"no official lab in {folder} (labs: {', '.join(grading.LABS)})")
    return labs


def _official_lab(name: str, solution) -> OfficialLab:
    from parlab import grading

    checks = [marker for cell in solution.cells if (marker := check_marker(cell))]
    expected = {
        marker[0]: verdict_lines(cell.get("outputs", [])) for cell in solution.cells if (marker := check_marker(cell))
    }
    answers = {n for cell in solution.cells if (n := answer_name(cell))}
    hints = {}
    for cell in solution.cells:
        if (check := hint_of(cell)) is not None:
            hints[check] = (hints.get(check, "") + "\n\n" + cell.source).strip()
    return OfficialLab(
        name, solution, student_version(solution), checks, answers, expected, grading.checks_module(name), hints
    )


def lab_key(name: str) -> str:
    """The part of a lab's name a file name starts with: "lab00" for lab00_ring_allreduce, "lab_bug_hunt" for the
    bug hunt (a lab without a number)."""
    number = re.match(r"lab\d+", name)
    return number[0] if number else name


def lab_of_file_name(path: Path, labs: dict[str, OfficialLab]) -> str | None:
    """The lab a file name says ("lab00_alice.ipynb" -> lab00_ring_allreduce), if one lab has that number."""
    key = re.match(r"lab\d+", path.name)
    if key:
        matches = [name for name in labs if lab_key(name) == key[0]]
    else:
        matches = [name for name in labs if not re.match(r"lab\d+", name) and path.name.startswith(name)]
    return matches[0] if len(matches) == 1 else None


def identify(submission, labs: dict[str, OfficialLab]) -> tuple[str | None, list[str]]:
    """The lab a submission is: its metadata's name if that is an official lab, else the lab whose answer cells
    it has. Returns (lab or None, notes)."""
    notes = []
    meta = submission.metadata.get("parlab", {})
    claimed = meta.get("lab") if isinstance(meta, dict) else None
    if isinstance(claimed, str) and claimed in labs:
        return claimed, notes
    if claimed is not None:
        notes.append(f"the notebook's metadata names an unknown lab {str(claimed)[:80]!r} (ignored)")
    answers = {name for cell in submission.cells if (name := answer_name(cell))}
    overlap = {name: len(answers & lab.answers) for name, lab in labs.items()}
    best = max(overlap, key=overlap.get)
    return (best if overlap[best] else None), notes


# ------------------------------------------------------------------------------------------------- grading


@dataclass
class CheckResult:
    check: str
    passed: bool
    points: int
    max_points: int
    detail: str = ""  # why it failed: the FAIL lines, the failing rank's error, a timeout


@dataclass
class NotebookGrade:
    notebook: str
    lab: str
    checks: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # answer cells that raised or were missing, tampering, ...
    error: str = ""  # the notebook could not be graded at all (unreadable, not a lab, the wrong lab)
    seconds: float = 0.0
    tampered: list[str] = field(default_factory=list)  # files under parlab/ or labs/ it changed (restored)
    timings: list[list] = field(default_factory=list)  # [kind, name, seconds] per code cell, as the worker said

    @property
    def points(self) -> int:
        return 0 if self.tampered else sum(c.points for c in self.checks)

    @property
    def max_points(self) -> int:
        return sum(c.max_points for c in self.checks)

    def to_dict(self) -> dict:
        return {
            "notebook": self.notebook,
            "lab": self.lab,
            "points": self.points,
            "max_points": self.max_points,
            "checks": [asdict(c) for c in self.checks],
            "notes": self.notes,
            "error": self.error or None,
            "tampered": self.tampered,
            "seconds": round(self.seconds, 2),
            "timings": self.timings,
        }

    def fail_all(self, lab: OfficialLab, detail: str) -> NotebookGrade:
        self.checks = [CheckResult(name, False, 0, points, detail) for name, points in lab.checks]
        return self


def mask(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def verdict_lines(outputs) -> list[str]:
    """The masked verdict lines (ending in ': PASS' or ': FAIL') a cell printed to stdout."""
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return [mask(line.rstrip()) for line in text.splitlines() if VERDICT_RE.search(line.rstrip())]


def score_lines(name: str, points: int, lines: list[str], expected: list[str]) -> CheckResult:
    """Score one check from the verdict lines the grader computed, against the solution's."""
    got = [mask(line.rstrip()) for line in lines if VERDICT_RE.search(line.rstrip())]  # the rest is information
    fails = [line for line in got if not line.endswith(": PASS")]
    if fails:
        detail = "; ".join(fails[:3]) + (f" (+{len(fails) - 3} more)" if len(fails) > 3 else "")
    elif not got:
        detail = "no verdict"
    elif got != expected:
        missing = [line for line in expected if line not in got]
        extra = [line for line in got if line not in expected]
        detail = f"verdicts differ from the solution's: missing {missing[:2]}, unexpected {extra[:2]}"
    else:
        return CheckResult(name, True, points, points)
    return CheckResult(name, False, 0, points, detail)


def assemble(submission, lab: OfficialLab):
    """The notebook that is executed: the lab as handed out, with the submission's answer cells in it.

    Returns (notebook, notes). An answer cell missing from the submission stays as handed out (it raises).
    """
    nb = copy.deepcopy(lab.handout)
    submitted, notes = {}, []
    for cell in submission.cells:
        name = answer_name(cell)
        if name is not None and name in submitted:
            notes.append(f"answer cell {name!r} appears more than once: the first one is graded")
        elif name is not None and isinstance(cell.get("source"), str):
            submitted[name] = cell.source
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None  # nothing stored is trusted
        name = answer_name(cell)
        if name is None:
            continue
        if name in submitted:
            cell.source = submitted[name]
        else:
            notes.append(f"answer cell {name!r} not found in the submission")
    return nb, notes


class Grader:
    """Grades submissions one after the other (or a few at once), each isolated from the grader and the others."""

    def __init__(self, labs: dict[str, OfficialLab], timeout: float, sandbox, guard):
        self.labs, self.timeout, self.sandbox, self.guard = labs, timeout, sandbox, guard
        self.running: set[int] = set()  # the worker pids being graded now (kill_tree spares the others)
        self.lock = threading.Lock()
        self.failed = False  # the grader itself failed on some submission

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
            if path.stat().st_size > MAX_NOTEBOOK_BYTES:
                raise ValueError(f"larger than {MAX_NOTEBOOK_BYTES >> 20} MB")
            submission = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
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

        from parlab.grading import OUT_ENV
        from parlab.grading.isolation import kill_tree, remove_scratch

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
                    "PYTHONPYCACHEPREFIX": str(scratch / "pycache"),  # never read or write the package's .pyc
                    "PYTHONPATH": str(PACKAGE.parent),  # the kernel imports this parlab, the one being guarded
                    "PYTHONWARNINGS": "ignore",
                }
            )
            worker = [sys.executable, str(PACKAGE / "grading" / "worker.py"), str(scratch)]
            visible = [PACKAGE.parent, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent]
            command = self.sandbox.wrap(worker, scratch, visible)
            with open(scratch / "worker.log", "ab") as log, self.lock:  # started and registered at once
                process = subprocess.Popen(
                    command, env=env, cwd=scratch, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True,
                )  # fmt: skip
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
            self._judge(lab, scratch, grade)
        finally:
            if os.environ.get("PARLAB_GRADE_KEEP"):  # debugging the grader: keep the worker's log and status
                grade.notes.append(f"scratch folder kept: {scratch}")
            else:
                remove_scratch(scratch)

    def _judge(self, lab: OfficialLab, scratch: Path, grade: NotebookGrade) -> None:
        """Score every check from the data its cell saved, judged here; explain every check without data."""
        import torch

        from parlab.grading import judge

        cells = _read_status(scratch / "status.json")
        log = _read_log(scratch / "worker.log")
        by_name = {(c.get("kind"), c.get("name")): c for c in cells}
        grade.timings = [[str(c.get("kind")), str(c.get("name")), c.get("seconds")] for c in cells if "seconds" in c]
        dead = ""
        for cell in cells:
            if cell.get("kind") == "answer" and not cell.get("skipped"):
                name = cell.get("name")
                if cell.get("killed"):
                    grade.notes.append(f"answer cell {name!r} ignored the interrupt after {self.timeout:g} s: killed")
                elif cell.get("timed_out"):
                    grade.notes.append(f"answer cell {name!r} timed out after {self.timeout:g} s (interrupted)")
                elif cell.get("error"):
                    grade.notes.append(f"answer cell {name!r} raised {_short(cell['error'])}")
            dead = dead or cell.get("dead") or ""
        if dead:
            grade.notes.append(dead)
        for name, points in lab.checks:
            cell = by_name.get(("check", name))
            data_path = scratch / "out" / f"{name}.pt"
            reason = _missing_reason(cell, self.timeout, log, dead)
            if cell is None or cell.get("skipped") or not data_path.is_file():
                grade.checks.append(CheckResult(name, False, 0, points, reason))
                continue
            try:
                if data_path.stat().st_size > MAX_DATA_BYTES:
                    raise ValueError(f"the check's data is larger than {MAX_DATA_BYTES >> 20} MB")
                data = torch.load(data_path, weights_only=True, map_location="cpu")  # data only: no code runs
                lines = judge(lab.module, name, data)
            except Exception as exc:
                detail = f"the check's data is malformed ({type(exc).__name__}: {str(exc)[:120]})"
                grade.checks.append(CheckResult(name, False, 0, points, detail))
                continue
            result = score_lines(name, points, lines, lab.expected[name])
            if not result.passed and isinstance(data, dict) and isinstance(data.get("error"), str):
                result.detail = _with_log_line(data["error"], cell, log)
            grade.checks.append(result)


def _short(text: str) -> str:
    from parlab.grading import informative_line

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
    from parlab.grading import informative_line

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
    if cell.get("error"):
        return _with_log_line(_short(str(cell["error"])), cell, log)
    return "the check cell saved no data"


# ---------------------------------------------------------------------------------------------- the report


def format_table(grades: list[NotebookGrade], sandbox: str = "") -> str:
    """The score table: one row per check, a total per notebook, and the total over all notebooks."""
    rows = [("notebook", "lab", "check", "result", "points")]
    details = {}
    for g in grades:
        if g.error and not g.checks:
            rows.append((g.notebook, g.lab, "-", "ERROR", "0/0"))
            details[len(rows) - 1] = [g.error]
        elif g.error:
            g_notes = [g.error]
            details.setdefault(len(rows), g_notes)
        for c in g.checks:
            result = "PASS" if c.passed and not g.tampered else "FAIL"
            points = 0 if g.tampered else c.points
            rows.append((g.notebook, g.lab, c.check, result, f"{points}/{c.max_points}"))
            lines = details.pop(len(rows) - 1, []) + ([c.detail] if c.detail else [])
            if lines:
                details[len(rows) - 1] = lines
        rows.append((g.notebook, g.lab, "total", "", f"{g.points}/{g.max_points}"))
        if g.notes:
            details[len(rows) - 1] = g.notes
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for index, row in enumerate(rows):
        lines.append("  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
        for detail in details.get(index, []):
            lines.append(f"    {detail}")
    points, max_points = sum(g.points for g in grades), sum(g.max_points for g in grades)
    lines.append(f"TOTAL {points}/{max_points} points over {len(grades)} notebook(s)")
    if sandbox:
        lines.append(f"sandbox: {sandbox}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m parlab grade`: exit 0 when every notebook was graded (whatever the scores), 1 if the grader
    itself failed, 2 on bad input."""
    parser = build_parser(argparse.ArgumentParser(prog="parlab grade"))
    return run(parser.parse_args(argv))


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = "Re-execute the answers of lab notebooks in the official labs and score their checks."
    parser.add_argument(
        "notebooks", nargs="+", metavar="NOTEBOOK", help="submitted lab notebooks (.ipynb), or folders of them"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--report", default=None, metavar="FILE", help="also write the JSON report to FILE")
    parser.add_argument(
        "--gradebook",
        default=None,
        metavar="CSV",
        help="write one row per student and lab to CSV, and a feedback file per student (see --feedback)",
    )
    parser.add_argument(
        "--feedback", default=None, metavar="DIR", help="folder of the feedback files (default: CSV's name + _feedback)"
    )
    parser.add_argument("--lab", default=None, help="the lab every notebook must be (default: from its file name)")
    parser.add_argument("--solutions", default=None, help="folder of solution notebooks (default: labs/solutions)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (one kernel each)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds an answer or check cell may run before it is interrupted (and killed 5 s later) and fails",
    )
    parser.add_argument(
        "--sandbox",
        choices=["auto", "bwrap", "none"],
        default="auto",
        help="run submissions in bubblewrap: auto (if it works here), bwrap (required), none",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from parlab.grading import gradebook
    from parlab.grading.isolation import Sandbox, TreeGuard, become_subreaper

    sys.dont_write_bytecode = True  # the grader's own imports must not change the package it guards
    missing = [p for p in args.notebooks if not (Path(p).is_file() or Path(p).is_dir())]
    if missing:
        print(f"parlab grade: error: no such notebook or folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    found = gradebook.notebooks_in(args.notebooks)
    if not found:
        print(f"parlab grade: error: no notebook (.ipynb) in {', '.join(args.notebooks)}", file=sys.stderr)
        return 2
    if args.feedback and not args.gradebook:
        print("parlab grade: error: --feedback goes with --gradebook", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"parlab grade: error: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"parlab grade: error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    try:  # everything the verdicts depend on, read before any student code runs
        labs = load_labs(args.solutions)
        sandbox = Sandbox(args.sandbox)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"parlab grade: error: {exc}", file=sys.stderr)
        return 2
    if args.lab is not None and args.lab not in labs:
        print(f"parlab grade: error: --lab {args.lab!r} is not one of {', '.join(labs)}", file=sys.stderr)
        return 2
    guard = TreeGuard([PACKAGE, LABS_DIR])
    become_subreaper()
    jobs = args.jobs
    if sandbox.kind == "none" and jobs > 1:  # tampering could not be told apart between concurrent submissions
        print("parlab grade: no sandbox: grading one notebook at a time", file=sys.stderr)
        jobs = 1
    grader = Grader(labs, args.timeout, sandbox, guard)

    def one(path: str) -> NotebookGrade:
        grade = grader.grade(path, args.lab)
        print(f"graded {path}: {grade.points}/{grade.max_points} ({grade.seconds:.0f} s)", file=sys.stderr, flush=True)
        return grade

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        grades = list(pool.map(one, [str(path) for path, _ in found]))
    points, max_points = sum(g.points for g in grades), sum(g.max_points for g in grades)
    report = {
        "notebooks": [g.to_dict() for g in grades],
        "points": points,
        "max_points": max_points,
        "sandbox": sandbox.kind,
        "sandbox_note": sandbox.describe(),
    }
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    if args.gradebook:
        write_class(args, labs, found, report["notebooks"])
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(grades, sandbox.describe()))
    return 1 if grader.failed else 0


def write_class(args: argparse.Namespace, labs: dict[str, OfficialLab], found, grades: list[dict]) -> None:
    """The gradebook (CSV) and a feedback file per student (parlab/grading/gradebook.py)."""
    from parlab.grading import gradebook

    students = []
    for (path, root), grade_ in zip(found, grades, strict=True):
        students.append(gradebook.student_of(path, root, grade_["lab"], lab_key(grade_["lab"]), _metadata(path)))
    table = gradebook.rows(grades, students, [root for _, root in found])
    csv_path = Path(args.gradebook)
    gradebook.write_gradebook(csv_path, table)
    folder = Path(args.feedback) if args.feedback else csv_path.with_name(f"{csv_path.stem}_feedback")
    hints = {name: _hints(lab) for name, lab in labs.items()}
    written = gradebook.write_feedback(folder, table, grades, students, hints)
    print(f"gradebook: {csv_path} ({len(table)} rows); feedback: {folder} ({len(written)} files)", file=sys.stderr)


def _hints(lab: OfficialLab) -> dict[str, str]:
    """A check's hint where its lab has no hint cell for it: what the check verifies."""
    structural = getattr(lab.module, "STRUCTURAL", {})
    return {check: f"the check verifies: {structural[check]}" for check, _ in lab.checks if check in structural} | {
        check: text for check, text in lab.hints.items()
    }


def _metadata(path: Path) -> dict:
    """A notebook's parlab metadata, read as data (only the student's name is taken from it), or {}."""
    try:
        if path.stat().st_size > MAX_NOTEBOOK_BYTES:
            return {}
        meta = json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get("parlab", {})
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}
