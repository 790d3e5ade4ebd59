"""A class at a time: `python -m parlab grade DIR --gradebook grades.csv`.

The grader (parlab/grading/command.py) scores each notebook; this module only names the student of each notebook and
writes what an instructor keeps: one CSV row per student and lab, and one short feedback file per student with each
failed check, why it failed and the lab's hint for it. Nothing here runs student code, and everything it writes is
in a fixed order (students, then labs, then checks), so grading the same folder twice writes the same files but
for the `seconds` column.

Whose notebook is it? The instructor's folder decides first, the notebook second:

    DIR/alice/lab00.ipynb               -> alice       (a folder per student)
    DIR/lab00_bob.ipynb                 -> bob         (the file name, less the lab's prefix)
    DIR/lab00_ring_allreduce_carol.ipynb -> carol      (the lab's full name is a prefix too)
    DIR/lab00_ring_allreduce.ipynb      -> the notebook's metadata parlab.student, else "lab00_ring_allreduce"

A notebook's metadata can claim any name, so it is used only where the file name says nothing; two notebooks of
the same student and lab both get a row, each marked as a duplicate, and neither replaces the other.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
COLUMNS = ["student", "lab", "notebook", "points", "max_points", "parts", "failed", "seconds", "notes"]


def notebooks_in(paths: list[str]) -> list[tuple[Path, Path | None]]:
    """Every notebook named or found (recursively, in sorted order) under a named folder, as (path, folder it was
    found in or None); checkpoints and hidden folders are skipped."""
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            for nb in sorted(path.rglob("*.ipynb")):
                parts = nb.relative_to(path).parts
                if not any(part.startswith(".") for part in parts):
                    found.append((nb, path))
        else:
            found.append((path, None))
    return found


def _clean(name: str) -> str:
    return UNSAFE.sub("_", name).strip("._-")[:80]


def student_of(path: Path, root: Path | None, lab: str, lab_key: str, metadata: dict | None = None) -> str:
    """The student a notebook belongs to (see the module docstring), as a name safe for a file."""
    if root is not None:
        relative = path.relative_to(root).parts
        if len(relative) > 1:  # DIR/<student>/...
            return _clean(relative[0]) or "unknown"
    stem = path.stem
    for prefix in sorted({lab, lab_key}, key=len, reverse=True):
        if prefix and stem.startswith(prefix):
            stem = stem[len(prefix) :]
            break
    name = _clean(stem)
    if name:
        return name
    claimed = (metadata or {}).get("student")
    if isinstance(claimed, str) and _clean(claimed):
        return _clean(claimed)
    return _clean(path.stem) or "unknown"


def rows(grades: list[dict], students: list[str], roots: list[Path | None]) -> list[dict]:
    """One row per graded notebook (a grade is NotebookGrade.to_dict()), sorted by student then lab."""
    out = []
    for grade, student, root in zip(grades, students, roots, strict=True):
        path = Path(grade["notebook"])
        notebook = str(path.relative_to(root)) if root is not None else path.name
        checks = grade["checks"]
        notes = ([grade["error"]] if grade.get("error") else []) + list(grade.get("notes", []))
        out.append(
            {
                "student": student,
                "lab": grade["lab"],
                "notebook": notebook,
                "points": grade["points"],
                "max_points": grade["max_points"],
                "parts": "; ".join(f"{c['check']} {c['points']}/{c['max_points']}" for c in checks),
                "failed": sum(not c["passed"] for c in checks),
                "seconds": f"{grade['seconds']:.1f}",
                "notes": " | ".join(notes),
            }
        )
    out.sort(key=lambda row: (row["student"], row["lab"], row["notebook"]))
    seen: dict[tuple[str, str], int] = {}
    for row in out:
        seen[(row["student"], row["lab"])] = seen.get((row["student"], row["lab"]), 0) + 1
    for row in out:
        if seen[(row["student"], row["lab"])] > 1:
            row["notes"] = "DUPLICATE: more than one notebook of this student and lab" + (
                f" | {row['notes']}" if row["notes"] else ""
            )
    return out


def write_gradebook(path: Path, table: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)


def feedback_text(student: str, grades: list[dict], hints: dict[str, dict[str, str]]) -> str:
    """A student's feedback: per lab the score, then each failed check with why and the lab's hint for it."""
    lines = [f"# Feedback for {student}", ""]
    for grade in sorted(grades, key=lambda g: (g["lab"], g["notebook"])):
        lines.append(f"## {grade['lab']} ({Path(grade['notebook']).name}): {grade['points']}/{grade['max_points']}")
        lines.append("")
        if grade.get("error"):
            lines += [f"- {grade['error']}", ""]
        failed = [c for c in grade["checks"] if not c["passed"]]
        if not failed and not grade.get("error"):
            lines += ["Every check passes.", ""]
        for check in failed:
            lines.append(f"- **{check['check']}** (0/{check['max_points']}): {check['detail'] or 'FAIL'}")
            hint = hints.get(grade["lab"], {}).get(check["check"])
            if hint:
                text = re.sub(r"^\*\*Hint[^*]*\*\*\s*", "", hint.strip())
                lines.append(f"  - hint: {' '.join(text.split())}")
        for note in grade.get("notes", []):
            lines.append(f"- note: {note}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_feedback(folder: Path, table: list[dict], grades: list[dict], students: list[str], hints) -> list[Path]:
    """One markdown file per student in `folder` (made if missing); returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for student in sorted(set(students)):
        own = [g for g, s in zip(grades, students, strict=True) if s == student]
        path = folder / f"{student}.md"
        path.write_text(feedback_text(student, own, hints), encoding="utf-8")
        written.append(path)
    return written


def write_class(args, labs: dict, found, grades: list[dict]) -> None:
    """`grade --gradebook CSV [--feedback DIR]`: the gradebook and a feedback file per student."""
    from parlab.grading.official import MAX_NOTEBOOK_BYTES, lab_key

    students = []
    for (path, root), grade_ in zip(found, grades, strict=True):
        students.append(
            student_of(path, root, grade_["lab"], lab_key(grade_["lab"]), _metadata(path, MAX_NOTEBOOK_BYTES))
        )
    table = rows(grades, students, [root for _, root in found])
    csv_path = Path(args.gradebook)
    write_gradebook(csv_path, table)
    folder = Path(args.feedback) if args.feedback else csv_path.with_name(f"{csv_path.stem}_feedback")
    hints = {name: _hints(lab) for name, lab in labs.items()}
    written = write_feedback(folder, table, grades, students, hints)
    print(f"gradebook: {csv_path} ({len(table)} rows); feedback: {folder} ({len(written)} files)", file=sys.stderr)


def _hints(lab) -> dict[str, str]:
    """A check's hint where its lab has no hint cell for it: what the check verifies."""
    structural = getattr(lab.module, "STRUCTURAL", {})
    return {check: f"the check verifies: {structural[check]}" for check, _ in lab.checks if check in structural} | {
        check: text for check, text in lab.hints.items()
    }


def _metadata(path: Path, max_bytes: int) -> dict:
    """A notebook's parlab metadata, read as data (only the student's name is taken from it), or {}."""
    try:
        if path.stat().st_size > max_bytes:
            return {}
        meta = json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get("parlab", {})
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}
