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
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from parlab.grading.markers import (  # noqa: F401  (the lab format, re-exported: grade.answer_name, ...)
    ANSWER_RE,
    BEGIN_RE,
    CHECK_RE,
    END_RE,
    HANDOUT_RE,
    HINT_WIDTH,
    VERDICT_RE,
    answer_name,
    check_marker,
    hint_of,
    strip_solution,
    student_version,
)
from parlab.grading.worker import kernel_manager  # noqa: F401  (labs/make_labs.py executes the solutions with it)

# The masks of tests/sanitize.cfg (tests/test_labs.py checks that they agree).
MASKS = [
    (re.compile(r"max \|err\| [0-9.]+e[-+][0-9]+"), "max |err| ERR"),
    (re.compile(r"at 0x[0-9a-f]+"), "at 0xADDRESS"),
]

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
    from parlab.grading.grader import Grader  # (it imports this module)

    grader = Grader(labs, args.timeout, sandbox, guard)

    def one(path: str) -> NotebookGrade:
        grade = grader.grade(path, args.lab)
        print(f"graded {path}: {grade.points}/{grade.max_points} ({grade.seconds:.0f} s)", file=sys.stderr, flush=True)
        return grade

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            grades = list(pool.map(one, [str(path) for path, _ in found]))
    finally:
        grader.close()
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
        from parlab.grading.gradebook import write_class

        write_class(args, labs, found, report["notebooks"])
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(grades, sandbox.describe()))
    return 1 if grader.failed else 0
