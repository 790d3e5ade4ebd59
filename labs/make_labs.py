"""Generate the student labs (labs/labNN_*.ipynb) from the solutions (labs/solutions/labNN_*.ipynb).

    python labs/make_labs.py            write every student notebook
    python labs/make_labs.py --check    exit 1 if a student notebook is not what its solution generates
    python labs/make_labs.py --execute  first re-execute the solutions in place (after editing one)
    python labs/make_labs.py --no-hints --out DIR   handouts without the hint cells, for instructors who want none

The solution is the one source. In its `# ANSWER: name` cells, each block between `# BEGIN SOLUTION: hint` and
`# END SOLUTION` becomes `raise NotImplementedError("hint")`, and no output is stored: a student sees verdicts only
from their own run, and a check cell whose verdicts FAIL raises, so `pytest --nbval` catches it
(parlab/grading/command.py). After editing a solution or its checks module (parlab/grading/labs/labNN_name.py), run
this with --execute: the solutions' stored outputs are the expected verdicts, the ones the grader compares its own
with. Adding a lab: labs/README.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

from parlab.grading.markers import student_version

LABS = Path(__file__).resolve().parent


def generate(solution_path: Path, hints: bool = True) -> str:
    """The student notebook, as the text written to labs/<name>.ipynb (hint cells left out with hints=False)."""
    solution = nbformat.read(solution_path, as_version=4)
    return nbformat.writes(student_version(solution, hints=hints)) + "\n"


def execute(solution_path: Path) -> None:
    """Re-execute a solution in place in a fresh kernel of this environment (no timestamps are stored)."""
    from nbclient import NotebookClient

    from parlab.grading.worker import kernel_manager

    nb = nbformat.read(solution_path, as_version=4)
    client = NotebookClient(nb, timeout=600, km=kernel_manager(), record_timing=False)
    client.execute(cwd=str(solution_path.parent))
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":  # launch progress lines: timing, never compared (conftest.py, grade)
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
    nbformat.write(nb, solution_path)
    print(f"executed labs/solutions/{solution_path.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the student notebooks are current")
    parser.add_argument("--execute", action="store_true", help="re-execute the solutions in place first")
    parser.add_argument("--no-hints", action="store_true", help="leave the hint cells out (needs --out)")
    parser.add_argument("--out", default=None, help="write the handouts to this folder instead of labs/")
    parser.add_argument("labs", nargs="*", help="lab names (default: all), e.g. lab00_ring_allreduce")
    args = parser.parse_args(argv)
    if args.no_hints and not args.out:
        parser.error("--no-hints writes elsewhere than labs/ (the handouts there keep their hints): give --out DIR")
    if args.out and args.check:
        parser.error("--check compares labs/ itself: no --out")
    out = Path(args.out) if args.out else LABS
    out.mkdir(parents=True, exist_ok=True)
    stale = []
    for solution_path in sorted((LABS / "solutions").glob("lab*.ipynb")):
        if args.labs and solution_path.stem not in args.labs:
            continue
        if args.execute:
            execute(solution_path)
        target = out / solution_path.name
        text = generate(solution_path, hints=not args.no_hints)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            target.write_text(text)
            print(f"wrote {target}")
    if args.check and stale:
        print(f"out of date (run python labs/make_labs.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
