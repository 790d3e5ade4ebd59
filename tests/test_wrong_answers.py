"""Every wrong answer in tests/wrong_solutions, and every untouched handout, run through its lab's checks.

The grading run (tests/test_grade_run.py) pays a fresh kernel, sandbox and rank server per notebook (~12 s of CPU);
it grades the solutions, the cheats and a few wrong answers end to end. Here the same collect and judge steps run
in this process, cell after cell as the kernel would run them, with one warm rank server for all of them: each
wrong answer must fail exactly the checks it names (its verdict lines scored against the solution's, as the
grader scores them) and each handout must fail every check without breaking anything.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import nbformat
import pytest
import torch

from parlab.grading import markers, official, scores
from parlab.grading.labs import OUT_ENV

ROOT = Path(__file__).resolve().parents[1]
WRONG = Path(__file__).resolve().parent / "wrong_solutions"
LABS = official.load_labs()
CASES = [(lab, path) for lab in LABS for path in sorted(WRONG.glob(f"{lab}*.py"))]


def wrong_answers(path: Path) -> tuple[dict[str, str], set[str]]:
    """The answer cells of a wrong-solution file (split at '# ANSWER: name' or '# PREDICT: name' lines) and the
    checks it must fail."""
    text = path.read_text()
    expect = re.search(r"^# EXPECT FAIL: (.+)$", text, re.M)
    assert expect, f"{path.name} says nothing about which checks must fail"
    parts = re.split(r"^(?=# (?:ANSWER|PREDICT): )", text, flags=re.M)[1:]
    answers = {markers.ANSWER_RE.match(p.split("\n", 1)[0])["name"]: p.split("\n", 1)[1].strip() for p in parts}
    return answers, {name.strip() for name in expect[1].split(",")}


def run_in_process(nb, lab: official.OfficialLab, as_solved_before: int = 0) -> dict[str, bool]:
    """Run a lab notebook's code cells in order in one namespace; score each check as the grader does.

    as_solved_before: the check cells before this cell index are the solution's checks on the solution's answers
    (nothing before it differs from the solution notebook, whose own run passes them: nbval re-executes it): they
    are scored as passed without running them again. Every cell from there on runs."""
    namespace = {"__name__": "__main__"}
    passed = {}
    dtype = torch.get_default_dtype()
    try:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            marker = markers.check_marker(cell)
            if marker and index < as_solved_before:
                passed[marker[0]] = True
                continue
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(cell.source, "<cell>", "exec"), namespace)
                error = None
            except Exception as exc:  # an answer that raises, a check that fails (CheckFailed) or breaks
                error = exc
            if marker:
                name, points = marker
                lines = out.getvalue().splitlines()
                ok = error is None and scores.score_lines(name, points, lines, lab.expected[name]).passed
                passed[name] = ok
    finally:
        torch.set_default_dtype(dtype)
    return passed


@pytest.fixture(autouse=True)
def _not_graded(monkeypatch):
    monkeypatch.delenv(OUT_ENV, raising=False)  # a check cell judges here and raises on a FAIL verdict


@pytest.mark.parametrize("lab, path", CASES, ids=[p.stem for _, p in CASES])
def test_a_wrong_answer_fails_exactly_the_checks_it_breaks(lab, path):
    official = LABS[lab]
    answers, failing = wrong_answers(path)
    assert set(answers) <= official.answers, f"{path.name} answers cells the lab does not have"
    assert failing <= {name for name, _ in official.checks}
    nb = nbformat.from_dict(nbformat.reads(nbformat.writes(official.solution), as_version=4))
    changed = []
    for index, cell in enumerate(nb.cells):
        if markers.answer_name(cell) in answers:
            source = f"# ANSWER: {markers.answer_name(cell)}\n{answers[markers.answer_name(cell)]}"
            if source.strip() != cell.source.strip():
                changed.append(index)
            cell.source = source
    assert changed, f"{path.name} answers every cell as the solution does"
    passed = run_in_process(nb, official, as_solved_before=min(changed))
    assert {name for name, ok in passed.items() if not ok} == failing, passed


@pytest.mark.parametrize("lab", list(LABS))
def test_an_untouched_handout_fails_every_check_without_breaking_anything(lab):
    passed = run_in_process(LABS[lab].handout, LABS[lab])
    assert set(passed) == {name for name, _ in LABS[lab].checks} and not any(passed.values()), passed


def test_every_lab_has_three_wrong_answers_here_one_of_them_the_librarys_code():
    for lab in LABS:
        paths = [path for name, path in CASES if name == lab]
        assert len(paths) >= 3, lab
        assert any(path.stem.startswith(f"{lab}__library") for path in paths), f"{lab}: no __library* wrong answer"
    assert os.environ.get(OUT_ENV) is None
