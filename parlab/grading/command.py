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
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from parlab.grading.official import DEFAULT_TIMEOUT, LABS_DIR, MAX_TIMEOUT, PACKAGE, load_labs
from parlab.grading.scores import NotebookGrade, format_table


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
        help="seconds an answer or check cell may run before it is interrupted (and killed 5 s later) and fails "
        f"(at most {MAX_TIMEOUT})",
    )
    parser.add_argument(
        "--no-hints",
        action="store_true",
        help="feedback files without the labs' hints (for handouts made without them)",
    )
    parser.add_argument(
        "--sandbox",
        choices=["auto", "bwrap", "none"],
        default="auto",
        help="run submissions in bubblewrap: auto (if it works here), bwrap (required), none",
    )
    return parser


def _error(message: str) -> int:
    print(f"parlab grade: error: {message}", file=sys.stderr)
    return 2


def _outputs_problem(args: argparse.Namespace) -> str:
    """Why an output the run will write (--report, --gradebook and the files beside it, --feedback) cannot be
    written, or ''. Each is tried now (a file opened for appending and removed again if it was new), not after an
    hour of grading."""
    files = [("--report", args.report)]
    if args.gradebook:
        from parlab.grading.gradebook import class_files

        files += [("--gradebook", str(path)) for path in class_files(Path(args.gradebook))]
    for option, name in files:
        if name is None:
            continue
        path = Path(name)
        if path.is_dir():
            return f"{option} {name} is a folder, not a file"
        existed = path.exists()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            return f"{option} {name} cannot be written: {exc.strerror or exc}"
        if not existed:
            path.unlink(missing_ok=True)
    if args.gradebook:
        folder = (
            Path(args.feedback)
            if args.feedback
            else Path(args.gradebook).with_name(f"{Path(args.gradebook).stem}_feedback")
        )
        if folder.exists() and not folder.is_dir():
            return f"--feedback {folder} is a file, not a folder"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".parlab-write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            return f"the feedback folder {folder} cannot be written: {exc.strerror or exc}"
    return ""


def run(args: argparse.Namespace) -> int:
    from parlab.grading import gradebook
    from parlab.grading.isolation import Sandbox, TreeGuard, become_subreaper

    sys.dont_write_bytecode = True  # the grader's own imports must not change the package it guards
    missing = [p for p in args.notebooks if not (Path(p).is_file() or Path(p).is_dir())]
    if missing:
        return _error(f"no such notebook or folder: {', '.join(missing)}")
    found, skipped = gradebook.notebooks_in(args.notebooks)
    for path, why in skipped:
        print(f"parlab grade: skipped {path}: {why}", file=sys.stderr)
    if not found:
        return _error(f"no notebook (.ipynb) to grade in {', '.join(args.notebooks)}")
    if args.feedback and not args.gradebook:
        return _error("--feedback goes with --gradebook")
    if not 0 < args.timeout <= MAX_TIMEOUT:  # (nan fails both comparisons)
        return _error(f"--timeout must be > 0 and at most {MAX_TIMEOUT} s, got {args.timeout}")
    if args.jobs < 1:
        return _error(f"--jobs must be >= 1, got {args.jobs}")
    problem = _outputs_problem(args)  # before any grading: a run's work is never lost to a path
    if problem:
        return _error(problem)
    try:  # everything the verdicts depend on, read before any student code runs
        labs = load_labs(args.solutions)
        sandbox = Sandbox(args.sandbox)
    except (ValueError, RuntimeError, OSError) as exc:
        return _error(str(exc))
    if args.lab is not None and args.lab not in labs:
        return _error(f"--lab {args.lab!r} is not one of {', '.join(labs)}")
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
        "skipped": [{"path": path, "why": why} for path, why in skipped],
    }
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    if args.gradebook:
        from parlab.grading.gradebook import write_class

        write_class(args, labs, found, report["notebooks"], skipped)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(grades, sandbox.describe()))
        for path, why in skipped:
            print(f"skipped {path}: {why}")
    return 1 if grader.failed else 0
