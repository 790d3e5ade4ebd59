"""A submission's score: the verdict lines of each check against the solution's, and the table of a class."""

from __future__ import annotations

import copy
import re
import unicodedata
from dataclasses import asdict, dataclass, field

from parlab.grading.markers import VERDICT_RE, answer_name, mask
from parlab.grading.official import OfficialLab


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


def score_lines(name: str, points: int, lines: list[str], expected: list[str]) -> CheckResult:
    """Score one check from the verdict lines the grader computed, against the solution's. The comparison masks
    what varies from run to run (max |err| digits); what the student reads keeps the real numbers."""
    verdicts = [line.rstrip() for line in lines if VERDICT_RE.search(line.rstrip())]  # the rest is information
    got = [mask(line) for line in verdicts]
    fails = [line for line in verdicts if not line.endswith(": PASS")]
    if fails:
        detail = failure_detail(fails)
    elif not got:
        detail = "no verdict"
    elif got != expected:
        missing = [line for line in expected if line not in got]
        extra = [line for line in got if line not in expected]
        detail = f"verdicts differ from the solution's: missing {missing[:2]}, unexpected {extra[:2]}"
    else:
        return CheckResult(name, True, points, points)
    return CheckResult(name, False, 0, points, detail)


_RANK = re.compile(r"\brank (\d+)\b")
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def failure_detail(fails: list[str], most: int = 4) -> str:
    """The FAIL lines of a check, one line per failure: lines that differ only in their rank (and the numbers that
    come with it) are shown once, with every rank that failed named ("ranks 0, 1, 2, 3: ..."), the first rank's
    numbers kept as they are."""
    groups: dict[str, tuple[str, list[str]]] = {}
    for line in fails:
        ranks = _RANK.findall(line)
        key = _NUMBER.sub("#", _RANK.sub("rank", line)) if ranks else line  # only a rank's lines are merged
        first, seen = groups.setdefault(key, (line, []))
        seen.extend(r for r in ranks[:1] if r not in seen)
    shown = []
    for first, ranks in groups.values():
        if len(ranks) > 1:
            first = _RANK.sub(f"ranks {', '.join(ranks)}", first, count=1)
        shown.append(first)
    more = len(shown) - most
    return "; ".join(shown[:most]) + (f" (+{more} more)" if more > 0 else "")


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


def display_width(text: str) -> int:
    """The columns `text` takes in a terminal: a wide character (CJK, most emoji) takes two, a combining mark none;
    so that the table's columns line up whatever script a student's name is in."""
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


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
    widths = [max(display_width(row[i]) for row in rows) for i in range(5)]
    lines = []
    for index, row in enumerate(rows):
        cells = (text + " " * (width - display_width(text)) for text, width in zip(row, widths, strict=True))
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
        for detail in details.get(index, []):
            lines.append(f"    {detail}")
    points, max_points = sum(g.points for g in grades), sum(g.max_points for g in grades)
    lines.append(f"TOTAL {points}/{max_points} points over {len(grades)} notebook(s)")
    if sandbox:
        lines.append(f"sandbox: {sandbox}")
    return "\n".join(lines)
