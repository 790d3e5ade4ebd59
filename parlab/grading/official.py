"""The official labs, as the grader knows them before any student code runs: each lab's solution, handout,
checks, answers, expected verdicts and hints; which lab a submission is; the grader's limits.

See parlab/grading/command.py for the whole procedure.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from parlab.grading.markers import answer_name, check_marker, hint_of, student_version, verdict_lines

DEFAULT_TIMEOUT = 120  # seconds per answer or check cell; the labs' own launches stop a hang sooner (60 s)
MAX_TIMEOUT = 3600  # a larger --timeout would let one hanging submission hold a class's grading for hours


GRACE = 5  # seconds between the interrupt of a cell past its timeout and the kill of its kernel
# A cell the grader adds before the first check cell: the rank server starts (imports torch) under the setup
# cells' timeout, not in the first check's (and not at all for a notebook killed in an answer cell).
WARM_UP = "import parlab\n\nparlab.launch(int, 1, echo=False)"
MAX_NOTEBOOK_BYTES = 20 * 2**20  # a submission larger than this is not read
MAX_DATA_BYTES = 200 * 2**20  # nor a check's data file larger than this
PACKAGE = Path(__file__).resolve().parents[1]  # parlab/
LABS_DIR = PACKAGE.parent / "labs"


def read_regular_file(path: Path, max_bytes: int) -> str:
    """The text of `path` if it is a regular file of at most `max_bytes`: opened without following a link and
    without waiting on a pipe, and checked on the opened file itself (a file swapped for a link between the folder's
    listing and this read is refused all the same)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes >> 20} MB")
    return data.decode("utf-8")


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

    from parlab.grading import labs as grading

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
    from parlab.grading import labs as grading

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
