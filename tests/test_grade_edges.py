"""The grader with a real class's files: names in any script, near-duplicates, links, pipes, empty and broken
files, a folder named like a spreadsheet formula; options and output paths checked before anything is graded; the
feedback students read and the class summary an instructor reads."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from parlab.grading import gradebook, scores, summary
from parlab.grading.official import read_regular_file

ROOT = Path(__file__).resolve().parents[1]
HANDOUT = ROOT / "labs" / "lab00_ring_allreduce.ipynb"
FORMULA = "=cmd|' -c calc'!A0"


def _grade(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "parlab", "grade", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# ------------------------------------------------------------------------------------------------ fast, no kernel


def test_names_are_kept_as_written_and_each_gets_a_feedback_file_of_its_own(tmp_path):
    names = {}
    for stem in [
        "lab00_李雷",
        "lab00_王芳",
        "lab00_José",
        "lab00_Jose\u0301",
        "lab00_Josè",
        "lab00_jo hn",
        "lab00_jo_hn",
    ]:
        names[stem] = gradebook.student_of(tmp_path / f"{stem}.ipynb", tmp_path, "lab00_ring_allreduce", "lab00")
    assert names["lab00_李雷"] == "李雷" and names["lab00_王芳"] == "王芳"
    assert names["lab00_José"] == names["lab00_Jose\u0301"] == "José"  # one spelling, composed or not
    assert len({names[s] for s in ["lab00_José", "lab00_Josè", "lab00_jo hn", "lab00_jo_hn", "lab00_李雷"]}) == 5
    files = {gradebook.file_name_of(n) for n in set(names.values())}
    assert len(files) == len(set(names.values()))
    assert all(f.isascii() and "/" not in f and not f.startswith(".") for f in files), files
    assert gradebook.student_of(tmp_path / "a\nb" / "lab00.ipynb", tmp_path, "lab00_x", "lab00") == "a?b"


def test_only_regular_files_are_graded_and_a_pipe_is_never_read(tmp_path):
    (tmp_path / "lab00_real.ipynb").write_text("{}")
    (tmp_path / "lab00_link.ipynb").symlink_to("/etc/passwd")
    os.mkfifo(tmp_path / "lab00_fifo.ipynb")
    (tmp_path / "sub").mkdir()
    (tmp_path / "linked_folder").symlink_to(tmp_path / "sub", target_is_directory=True)
    (tmp_path / "sub" / "lab00_x.ipynb").write_text("{}")
    found, skipped = gradebook.notebooks_in([str(tmp_path)])
    assert [p.name for p, _ in found] == ["lab00_real.ipynb", "lab00_x.ipynb"]  # sub/ once, not again via the link
    assert {Path(p).name: why.split(" (")[0] for p, why in skipped} == {
        "lab00_fifo.ipynb": "a named pipe",
        "lab00_link.ipynb": "a symbolic link",
    }
    started = time.monotonic()
    for name in ("lab00_fifo.ipynb", "lab00_link.ipynb"):
        with pytest.raises((OSError, ValueError)):
            read_regular_file(tmp_path / name, 1000)
    assert time.monotonic() - started < 1
    assert json.loads(read_regular_file(tmp_path / "lab00_real.ipynb", 1000)) == {}


def test_cells_a_spreadsheet_would_run_are_quoted():
    for text in ("=1+1", "+1", "-1", "@SUM(A1)", FORMULA):
        assert gradebook.spreadsheet_safe(text) == "'" + text
    assert gradebook.spreadsheet_safe("alice") == "alice" and gradebook.spreadsheet_safe(3) == 3


@pytest.mark.parametrize(
    "options, words",
    [
        (["--timeout", "inf"], "--timeout must be > 0 and at most"),
        (["--timeout", "nan"], "--timeout must be > 0 and at most"),
        (["--gradebook", "{tmp}"], "is a folder, not a file"),
        (["--gradebook", "{tmp}/g.csv", "--feedback", "{tmp}/file"], "is a file, not a folder"),
        (["--report", "/proc/parlab-report.json"], "cannot be written"),
        (["--report", "{tmp}"], "is a folder, not a file"),
    ],
)
def test_bad_options_and_unwritable_outputs_are_refused_before_any_grading(tmp_path, options, words):
    (tmp_path / "file").write_text("x")
    started = time.monotonic()
    done = _grade(*[o.replace("{tmp}", str(tmp_path)) for o in options], str(HANDOUT), timeout=120)
    assert done.returncode == 2 and "parlab grade: error: " in done.stderr and words in done.stderr, done.stderr
    assert "graded " not in done.stderr and time.monotonic() - started < 30  # no kernel was started


def test_feedback_lines_keep_the_real_numbers_and_name_each_failing_rank_once():
    fail = "rank {r}: gradients after averaging: DIFFERS from single device: max |err| {e} > tol 1e-10 (float64): FAIL"
    lines = [fail.format(r=r, e=e) for r, e in [(0, "3.0e-01"), (1, "3.1e-01"), (2, "2.9e-01")]]
    lines += ["P=2: bytes: measured 8 != theory 0: FAIL", "P=4: bytes: measured 16 != theory 0: FAIL"]
    result = scores.score_lines("average", 3, lines, [])
    assert result.detail.startswith("ranks 0, 1, 2: gradients after averaging") and "3.0e-01" in result.detail
    assert "P=2: bytes" in result.detail and "P=4: bytes" in result.detail and "ERR" not in result.detail


def test_the_score_table_lines_up_names_in_any_script():
    """A CJK name takes two terminal columns per character: the table pads by what a terminal shows."""
    grades = [
        scores.NotebookGrade(notebook=name, lab="lab00", checks=[scores.CheckResult("ring", True, 2, 2, "")])
        for name in ("lab00_李雷.ipynb", "lab00_bob.ipynb", "lab00_Zoë.ipynb")
    ]
    rows = [line for line in scores.format_table(grades).splitlines() if line.startswith("lab00_")]
    starts = {scores.display_width(line[: line.index("lab00 ")]) for line in rows}
    assert len(rows) == 6 and len(starts) == 1, rows  # the lab column starts at one terminal column on every row
    assert scores.display_width("李雷") == 4 and scores.display_width("Zoe\u0308") == 3


def test_the_class_summary_counts_what_the_class_did():
    def grade(student_lab_points, checks):
        return {"lab": student_lab_points, "points": sum(p for _, _, p in checks), "max_points": 5, "checks": [
            {"check": c, "passed": ok, "points": p, "max_points": {"a": 2, "b": 3}[c], "detail": "" if ok else d}
            for c, ok, p, d in [(c, ok, p, "x: FAIL") for c, ok, p in checks]]}  # fmt: skip

    grades = [
        grade("lab00", [("a", True, 2), ("b", True, 3)]),
        grade("lab00", [("a", True, 2), ("b", False, 0)]),
        {**grade("lab00", [("a", False, 0), ("b", False, 0)]), "checks": [{
            "check": c, "passed": False, "points": 0, "max_points": 1, "detail": "not attempted: stub"} for c in "ab"]},
        grade("lab01", [("a", True, 2)]),
    ]  # fmt: skip
    students = ["ann", "bob", "cy", "ann"]
    table = [{"student": s, "lab": g["lab"], "points": g["points"]} for s, g in zip(students, grades, strict=True)]
    out = summary.class_summary(table, grades, students)
    lab00 = out["labs"]["lab00"]
    assert (lab00["submissions"], lab00["mean"], lab00["median"], lab00["min"], lab00["max"]) == (2, 3.5, 3.5, 2, 5)
    assert lab00["distribution"] == [0, 0, 1, 0, 0, 1] and lab00["handed_in"] == 3  # cy handed the stub in
    assert "| lab00 (/5) | 2 (of 3) | 3.5 | 3.5 | 2-5 |" in summary.markdown(out)
    assert {c["check"]: (c["passed"], c["attempted"]) for c in lab00["checks"]} == {"a": (2, 2), "b": (1, 2)}
    assert lab00["not_attempted"] == ["cy"] and out["labs"]["lab01"]["not_attempted"] == ["bob", "cy"]
    columns, rows = summary.wide_rows(table)
    assert columns == ["student", "lab00", "lab01", "total"]
    assert rows[0] == {"student": "ann", "lab00": 5, "lab01": 2, "total": 7} and rows[2]["lab01"] == ""
    assert "b (3 pts) | 1/2 | 50%" in summary.markdown(out) and "<svg" in summary.html_page(out)


# --------------------------------------------------------------------------------------- one run over a class


@pytest.mark.slow
def test_a_class_folder_with_every_kind_of_file_is_graded_in_one_run(tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    nbformat.write(nbformat.read(HANDOUT, as_version=4), folder / "lab00_李雷.ipynb")  # a real (untouched) notebook
    (folder / "lab00_王芳.ipynb").write_text('{"cells": [ not json')
    (folder / "lab00_José.ipynb").write_text("")
    (folder / "lab00_Josè.ipynb").write_text("")
    (folder / "lab00_jo hn.ipynb").write_text("[]")
    (folder / "lab00_jo_hn.ipynb").write_text("[]")
    (folder / "lab00_link.ipynb").symlink_to("/etc/passwd")
    os.mkfifo(folder / "lab00_fifo.ipynb")
    (folder / FORMULA).mkdir()
    (folder / FORMULA / "lab00.ipynb").write_text("{}")
    book = tmp_path / "out" / "grades.csv"
    done = _grade(str(folder), "--gradebook", str(book), "--report", str(tmp_path / "r.json"), "--timeout", "30")
    assert done.returncode == 0, done.stderr[-2000:]
    with open(book, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    students = sorted(row["student"] for row in rows)
    assert students == sorted(["李雷", "王芳", "José", "Josè", "jo hn", "jo_hn", "'" + FORMULA])
    assert not any("DUPLICATE" in row["notes"] for row in rows)
    assert book.read_bytes().startswith("\ufeffstudent,".encode())  # a BOM: spreadsheets read the names as UTF-8
    everything = book.read_text() + (tmp_path / "r.json").read_text() + done.stdout
    feedback = sorted((tmp_path / "out" / "grades_feedback").glob("*.md"))
    everything += "".join(p.read_text() for p in feedback)
    assert "root:x:" not in everything  # the link was never read
    assert len(feedback) == 7 and "# Feedback for 李雷" in everything
    report = json.loads((tmp_path / "r.json").read_text())
    assert {Path(s["path"]).name for s in report["skipped"]} == {"lab00_link.ipynb", "lab00_fifo.ipynb"}
    lilei = next(g for g in report["notebooks"] if "李雷" in g["notebook"])
    assert lilei["points"] == 0 and all(c["detail"].startswith("not attempted") for c in lilei["checks"])
    for name in ("grades_summary.md", "grades_summary.html", "grades_wide.csv"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "lab00_ring_allreduce" in (tmp_path / "out" / "grades_summary.md").read_text()
