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
    DIR/lab00_李雷.ipynb                 -> 李雷        (names are kept as written, in any script)
    DIR/lab00_ring_allreduce.ipynb      -> the notebook's metadata parlab.student, else "lab00_ring_allreduce"

A notebook's metadata can claim any name, so it is used only where the file name says nothing; two notebooks of
the same student and lab both get a row, each marked as a duplicate, and neither replaces the other. A feedback
file is named by an ASCII slug of the name and a short hash of it as written (`Jose-3f2a9c1d.md`), so that no two
students share one. Only regular files are graded (links, pipes and devices are named as skipped), and every CSV
cell that a spreadsheet would read as a formula starts with a quote.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import stat
import sys
import unicodedata
from pathlib import Path

from parlab.grading.summary import name_order, write_summary

# feedback: the name of the student's feedback file (an ASCII slug and a hash: which file is whose, at a glance)
COLUMNS = ["student", "lab", "notebook", "points", "max_points", "parts", "failed", "seconds", "notes", "feedback"]
SEPARATORS = "_-. "  # what joins a lab's prefix to a student's name in a file name (lab00_bob, lab00-bob)
SPREADSHEET_FORMULA = ("=", "+", "-", "@", "\t", "\r")  # a cell starting so is a formula to a spreadsheet


def notebooks_in(paths: list[str]) -> tuple[list[tuple[Path, Path | None]], list[tuple[str, str]]]:
    """Every notebook named or found under a named folder (recursively, in sorted order, never through a link),
    as (path, folder it was found in or None); checkpoints and hidden folders are skipped. Only regular files are
    graded: a link, a pipe or a device is left out and named in the second list, (path, why)."""
    found, skipped = [], []

    def consider(path: Path, root: Path | None) -> None:
        why = not_a_regular_file(path)
        if why:
            skipped.append((str(path), why))
        else:
            found.append((path, root))

    for name in paths:
        path = Path(name)
        if path.is_dir() and not path.is_symlink():
            for folder, subfolders, files in os.walk(path):  # os.walk follows no link to a folder
                subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
                for file in sorted(files):
                    if file.endswith(".ipynb") and not file.startswith("."):
                        consider(Path(folder) / file, path)
        else:
            consider(path, None)
    found.sort(key=lambda item: str(item[0]))
    return found, skipped


def not_a_regular_file(path: Path) -> str:
    """Why `path` is not graded ('' when it is a regular file): a symbolic link could show any file on the
    machine to the class's report, and reading a pipe waits for ever."""
    try:
        mode = path.lstat().st_mode
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(mode):
        return "a symbolic link (only regular files are graded)"
    if stat.S_ISFIFO(mode):
        return "a named pipe (only regular files are graded)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device (only regular files are graded)"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    return ""


def _as_written(name: str) -> str:
    """A name as the student wrote it (Unicode kept, in its composed form so that one spelling is one student),
    less the separators around it and any control character."""
    name = unicodedata.normalize("NFC", name)
    name = "".join("?" if unicodedata.category(ch).startswith("C") else ch for ch in name)
    return name.strip(SEPARATORS)[:120]


def student_of(path: Path, root: Path | None, lab: str, lab_key: str, metadata: dict | None = None) -> str:
    """The student a notebook belongs to (see the module docstring), as written: "李雷", "José", "jo hn"."""
    if root is not None:
        relative = path.relative_to(root).parts
        if len(relative) > 1:  # DIR/<student>/...
            return _as_written(relative[0]) or "unknown"
    stem = path.stem
    for prefix in sorted({lab, lab_key}, key=len, reverse=True):
        if prefix and stem.startswith(prefix):
            stem = stem[len(prefix) :]
            break
    name = _as_written(stem)
    if name:
        return name
    claimed = (metadata or {}).get("student")
    if isinstance(claimed, str) and _as_written(claimed):
        return _as_written(claimed)
    return _as_written(path.stem) or "unknown"


def file_name_of(student: str) -> str:
    """A feedback file's name for `student`: safe on any file system and unique to the name as written (José and
    Josè, jo hn and jo_hn, 李雷 and 王芳 each get their own): an ASCII slug, then a short hash of the full name."""
    ascii_name = unicodedata.normalize("NFKD", student).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", ascii_name).strip("-")[:40] or "student"
    return f"{slug}-{hashlib.sha256(student.encode('utf-8')).hexdigest()[:8]}.md"


def spreadsheet_safe(value):
    """A CSV cell a spreadsheet shows as text: one that starts like a formula gets a leading quote (the usual
    CSV-injection rule)."""
    return f"'{value}" if isinstance(value, str) and value.startswith(SPREADSHEET_FORMULA) else value


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
                "feedback": file_name_of(student),
            }
        )
    out.sort(key=lambda row: (*name_order(row["student"]), row["lab"], row["notebook"]))
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
    with open(path, "w", newline="", encoding="utf-8-sig") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({key: spreadsheet_safe(value) for key, value in row.items()} for row in table)


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
        path = folder / file_name_of(student)
        path.write_text(feedback_text(student, own, hints), encoding="utf-8")
        written.append(path)
    return written


def class_files(csv_path: Path) -> list[Path]:
    """The files `--gradebook CSV` writes beside the feedback folder: the gradebook, the wide CSV and the class
    summary (Markdown and HTML; parlab/grading/summary.py)."""
    return [csv_path, *summary_paths(csv_path).values()]


def summary_paths(csv_path: Path) -> dict[str, Path]:
    stem = csv_path.stem
    return {
        "wide": csv_path.with_name(f"{stem}_wide.csv"),
        "md": csv_path.with_name(f"{stem}_summary.md"),
        "html": csv_path.with_name(f"{stem}_summary.html"),
    }


def write_class(args, labs: dict, found, grades: list[dict], skipped=()) -> None:
    """`grade --gradebook CSV [--feedback DIR] [--no-hints]`: the gradebook, a feedback file per student, the wide
    CSV and the class summary."""
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
    hints = {} if getattr(args, "no_hints", False) else {name: _hints(lab) for name, lab in labs.items()}
    written = write_feedback(folder, table, grades, students, hints)
    write_summary(summary_paths(csv_path), table, grades, students, skipped, spreadsheet_safe)
    print(
        f"gradebook: {csv_path} ({len(table)} rows); feedback: {folder} ({len(written)} files); class summary: "
        f"{summary_paths(csv_path)['md'].name}, {summary_paths(csv_path)['html'].name}, "
        f"{summary_paths(csv_path)['wide'].name}",
        file=sys.stderr,
    )


def _hints(lab) -> dict[str, str]:
    """A check's hint where its lab has no hint cell for it: what the check verifies."""
    structural = getattr(lab.module, "STRUCTURAL", {})
    return {check: f"the check verifies: {structural[check]}" for check, _ in lab.checks if check in structural} | {
        check: text for check, text in lab.hints.items()
    }


def _metadata(path: Path, max_bytes: int) -> dict:
    """A notebook's parlab metadata, read as data (only the student's name is taken from it), or {}."""
    from parlab.grading.official import read_regular_file

    try:
        meta = json.loads(read_regular_file(path, max_bytes)).get("metadata", {}).get("parlab", {})
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}
