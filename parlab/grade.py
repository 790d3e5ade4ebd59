"""Grade lab notebooks by re-executing them: `python -m parlab grade NOTEBOOK... [--json]`.

A lab (labs/solutions/labNN_*.ipynb) has three kinds of cells, marked by their first line:

    # ANSWER: name                    the student writes code here; the solution's code sits between
                                       `# BEGIN SOLUTION: hint` and `# END SOLUTION` lines
    # CHECK: name (N points)          runs the student's code on live ranks and prints verdict lines
    anything else                      explanation, setup, helpers: the same for everyone

The student version (labs/labNN_*.ipynb) is generated from the solution by `student_version` (see
labs/make_labs.py): each solution block becomes `raise NotImplementedError("hint")`, every stored output is kept,
so the stored outputs of the check cells are the expected verdicts and `pytest --nbval` on a completed notebook
passes exactly when the student's code is right.

Grading a submission never trusts what it stores. `grade_notebook` takes the lab as handed out (the student
version of the official solution), puts the submission's ANSWER cells into it, executes it in a fresh kernel, and
scores each CHECK cell from its fresh output: a check passes when it ran without error, printed at least one
verdict line, no verdict FAILed, and its verdict lines equal those stored in the solution (after masking the
digits of max |err|, as tests/sanitize.cfg does for nbval). Everything else in the submission (edited outputs,
edited check or setup cells, extra cells) is ignored. An answer or check cell that runs past the timeout is
interrupted (which stops its ranks) and fails; later cells still run; if the kernel dies, the remaining checks
fail and grading goes on with the next notebook.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The masks of tests/sanitize.cfg (tests/test_labs.py checks that they agree).
MASKS = [
    (re.compile(r"max \|err\| [0-9.]+e[-+][0-9]+"), "max |err| ERR"),
    (re.compile(r"at 0x[0-9a-f]+"), "at 0xADDRESS"),
]

ANSWER_RE = re.compile(r"^#\s*ANSWER:\s*(?P<name>\S+)\s*$")
CHECK_RE = re.compile(r"^#\s*CHECK:\s*(?P<name>\S+)\s*\((?P<points>\d+)\s*points?\)\s*$")
BEGIN_RE = re.compile(r"^(?P<indent>\s*)#\s*BEGIN SOLUTION(?::\s*(?P<hint>.*?))?\s*$")
END_RE = re.compile(r"^\s*#\s*END SOLUTION\s*$")
VERDICT_RE = re.compile(r": (PASS|FAIL)$")
HINT_WIDTH = 100  # the student version's hint lines stay within this many characters

DEFAULT_TIMEOUT = 120  # seconds per answer or check cell; the labs' own launches stop a hang sooner (60 s)


def repo_solutions() -> Path:
    """labs/solutions next to the parlab package (an editable install or a checkout)."""
    return Path(__file__).resolve().parents[1] / "labs" / "solutions"


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


def lab_id(nb, path: Path | None = None) -> str:
    """The lab a notebook belongs to: its metadata (parlab.lab), else its file name up to the first dot."""
    lab = nb.metadata.get("parlab", {}).get("lab")
    if lab:
        return lab
    if path is None:
        raise ValueError("the notebook has no parlab.lab metadata and no file name")
    return path.name.split(".")[0]


# ------------------------------------------------------------------------------------- the student version


def strip_solution(source: str) -> str:
    """Replace every `# BEGIN SOLUTION: hint` ... `# END SOLUTION` block by `raise NotImplementedError("hint")`."""
    out, inside = [], False
    for number, line in enumerate(source.split("\n"), start=1):
        begin, end = BEGIN_RE.match(line), END_RE.match(line)
        if begin:
            if inside:
                raise ValueError(f"line {number}: BEGIN SOLUTION inside another solution block")
            inside = True
            indent, hint = begin["indent"], begin["hint"] or "write this part"
            out.append(f"{indent}# YOUR CODE HERE")
            if len(indent) + len(hint) <= HINT_WIDTH - 30:
                out.append(f"{indent}raise NotImplementedError({json.dumps(hint)})")
            else:  # a long hint: one string in pieces, one per line, short enough for a projector
                pieces = textwrap.wrap(hint, HINT_WIDTH - len(indent) - 6, drop_whitespace=False)
                out.append(f"{indent}raise NotImplementedError(")
                out.extend(f"{indent}    {json.dumps(piece)}" for piece in pieces)
                out.append(f"{indent})")
        elif end:
            if not inside:
                raise ValueError(f"line {number}: END SOLUTION without BEGIN SOLUTION")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("BEGIN SOLUTION without END SOLUTION")
    return "\n".join(out)


def student_version(solution):
    """The notebook handed to students: solution blocks stripped, every stored output kept (the expected ones)."""
    nb = copy.deepcopy(solution)
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
    if not answers:
        raise ValueError("the notebook has no '# ANSWER: name' cell")
    if not any(check_marker(c) for c in nb.cells):
        raise ValueError("the notebook has no '# CHECK: name (N points)' cell")
    return nb


# ------------------------------------------------------------------------------------------------- grading


@dataclass
class CheckResult:
    check: str
    passed: bool
    points: int
    max_points: int
    detail: str = ""  # why it failed: the FAIL lines, the error (with the failing rank's traceback), a timeout


@dataclass
class NotebookGrade:
    notebook: str
    lab: str
    checks: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # answer cells that raised or were missing, a dead kernel
    error: str = ""  # the notebook could not be graded at all (not a lab, unreadable)

    @property
    def points(self) -> int:
        return sum(c.points for c in self.checks)

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
        }


def mask(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def verdict_lines(outputs) -> list[str]:
    """The masked verdict lines (ending in ': PASS' or ': FAIL') a cell printed to stdout."""
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return [mask(line.rstrip()) for line in text.splitlines() if VERDICT_RE.search(line.rstrip())]


def _error_text(outputs) -> str:
    """The error a cell raised, short: its type and message (for a RankError: the rank's last traceback line)."""
    for o in outputs:
        if o.get("output_type") == "error":
            ename, evalue = o.get("ename", "Error"), o.get("evalue", "")
            lines = [line for line in evalue.splitlines() if line.strip()]
            if ename == "RankError" and lines:  # "rank 1 failed; ...", then the remote traceback: keep its end
                return f"{lines[0]} {lines[-1].strip()}"
            return f"{ename}: {lines[0] if lines else ''}".strip()
    return ""


def score_check(name: str, points: int, outputs, expected: list[str], timed_out: float | None) -> CheckResult:
    """Score one check cell from its fresh outputs against the solution's verdict lines."""
    got = verdict_lines(outputs)
    error = _error_text(outputs)
    fails = [line for line in got if line.endswith(": FAIL")]
    if timed_out is not None:
        detail = f"timed out after {timed_out:g} s (interrupted)"
    elif error:
        detail = error
    elif fails:
        detail = "; ".join(fails[:3]) + (f" (+{len(fails) - 3} more)" if len(fails) > 3 else "")
    elif not got:
        detail = "printed no verdict line"
    elif got != expected:
        missing = [line for line in expected if line not in got]
        extra = [line for line in got if line not in expected]
        detail = f"verdicts differ from the solution's: missing {missing[:2]}, unexpected {extra[:2]}"
    else:
        return CheckResult(name, True, points, points)
    return CheckResult(name, False, 0, points, detail)


def kernel_manager():
    """A kernel in the current Python environment (like nbval's --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(
                resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict()
            )

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())


def load_solution(lab: str, solutions: Path):
    import nbformat

    path = solutions / f"{lab}.ipynb"
    number = re.match(r"lab\d+", lab)
    if not path.exists() and number:  # a renamed file without metadata ("lab00_alice"): match on "lab00_"
        candidates = sorted(solutions.glob(f"{number[0]}_*.ipynb"))
        path = candidates[0] if len(candidates) == 1 else path
    if not path.exists():
        known = sorted(p.stem for p in solutions.glob("lab*.ipynb"))
        raise ValueError(f"no solution for lab {lab!r} in {solutions.name}/ (labs: {', '.join(known) or 'none'})")
    return nbformat.read(path, as_version=4)


def assemble(submission, solution):
    """The notebook that is executed: the lab as handed out, with the submission's answer cells in it.

    Returns (notebook, notes). An answer cell missing from the submission stays as handed out (it raises).
    """
    nb = student_version(solution)
    submitted, notes = {}, []
    for cell in submission.cells:
        name = answer_name(cell)
        if name is not None and name in submitted:
            notes.append(f"answer cell {name!r} appears more than once: the first one is graded")
        elif name is not None:
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


def grade_notebook(
    path: str | Path, solutions: str | Path | None = None, timeout: float = DEFAULT_TIMEOUT
) -> NotebookGrade:
    """Execute one submission (its answer cells in the official lab) and score its checks. Never raises for a
    bad submission: what went wrong is in the result's checks, notes or error."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    path = Path(path)
    solutions = Path(solutions) if solutions is not None else repo_solutions()
    try:
        submission = nbformat.read(path, as_version=4)
        lab = lab_id(submission, path)
        solution = load_solution(lab, solutions)
        lab = lab_id(solution, None) if solution.metadata.get("parlab", {}).get("lab") else lab
        nb, notes = assemble(submission, solution)
    except Exception as exc:  # unreadable, not a lab, no solution: say so and go on with the next notebook
        return NotebookGrade(str(path), path.name.split(".")[0], error=f"{type(exc).__name__}: {exc}")

    expected = {}
    for cell in solution.cells:
        marker = check_marker(cell)
        if marker:
            expected[marker[0]] = verdict_lines(cell.get("outputs", []))
    result = NotebookGrade(str(path), lab, notes=notes)

    def cell_timeout(cell) -> float:  # the official setup cells may take longer (imports, a first launch)
        return timeout if answer_name(cell) or check_marker(cell) else max(timeout, DEFAULT_TIMEOUT)

    client = NotebookClient(
        nb, timeout_func=cell_timeout, allow_errors=True, interrupt_on_timeout=True, km=kernel_manager()
    )
    dead = ""
    try:
        with tempfile.TemporaryDirectory(prefix="parlab-grade-") as workdir, client.setup_kernel(cwd=workdir):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                marker = check_marker(cell)
                if dead:
                    if marker:
                        result.checks.append(CheckResult(marker[0], False, 0, marker[1], dead))
                    continue
                started = time.monotonic()
                try:
                    client.execute_cell(cell, index)
                except DeadKernelError:
                    dead = f"the kernel died (in cell {index})"
                    result.notes.append(dead)
                seconds = time.monotonic() - started
                timed_out = cell_timeout(cell) if seconds >= cell_timeout(cell) else None
                name = answer_name(cell)
                if name is not None and timed_out:
                    result.notes.append(f"answer cell {name!r} timed out after {timed_out:g} s (interrupted)")
                elif name is not None and (error := _error_text(cell.outputs)):
                    result.notes.append(f"answer cell {name!r} raised {error}")
                if marker:
                    outputs = [] if dead else cell.outputs
                    check = score_check(marker[0], marker[1], outputs, expected[marker[0]], timed_out)
                    if dead:
                        check.detail = dead
                    result.checks.append(check)
    except Exception as exc:  # the kernel did not start, or died in a way nbclient reports differently
        result.error = f"{type(exc).__name__}: {exc}"
        graded = {c.check for c in result.checks}
        for cell in nb.cells:
            marker = check_marker(cell)
            if marker and marker[0] not in graded:
                result.checks.append(CheckResult(marker[0], False, 0, marker[1], result.error))
    return result


# ---------------------------------------------------------------------------------------------- the report


def format_table(grades: list[NotebookGrade]) -> str:
    """The score table: one row per check, a total per notebook, and the total over all notebooks."""
    rows = [("notebook", "lab", "check", "result", "points")]
    details = {}
    for g in grades:
        if g.error:
            rows.append((g.notebook, g.lab, "-", "ERROR", "0/0"))
            details[len(rows) - 1] = [g.error]
        for c in g.checks:
            rows.append((g.notebook, g.lab, c.check, "PASS" if c.passed else "FAIL", f"{c.points}/{c.max_points}"))
            if c.detail:
                details[len(rows) - 1] = [c.detail]
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m parlab grade`: exit 0 if every check of every notebook passed, 1 otherwise, 2 on bad input."""
    parser = build_parser(argparse.ArgumentParser(prog="parlab grade"))
    return run(parser.parse_args(argv))


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = "Re-execute lab notebooks and score their check cells against the solutions."
    parser.add_argument("notebooks", nargs="+", metavar="NOTEBOOK", help="submitted lab notebooks (.ipynb)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--solutions", default=None, help="folder of solution notebooks (default: labs/solutions)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (one kernel each)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds an answer or check cell may run before it is interrupted and fails",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    missing = [p for p in args.notebooks if not Path(p).is_file()]
    if missing:
        print(f"parlab grade: error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"parlab grade: error: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"parlab grade: error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2

    def one(path: str) -> NotebookGrade:
        grade = grade_notebook(path, args.solutions, args.timeout)
        if not args.json:
            print(f"graded {path}: {grade.points}/{grade.max_points}", file=sys.stderr, flush=True)
        return grade

    # Each notebook runs in its own kernel with its own ranks, so several can be graded at once.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        grades = list(pool.map(one, args.notebooks))
    if args.json:
        points, max_points = sum(g.points for g in grades), sum(g.max_points for g in grades)
        print(json.dumps({"notebooks": [g.to_dict() for g in grades], "points": points, "max_points": max_points}))
    else:
        print(format_table(grades))
    full = all(not g.error and g.max_points and g.points == g.max_points for g in grades)
    return 0 if full else 1
