"""One run of `python -m parlab grade --timeout 20` over a folder of every kind of submission an instructor meets.

Next to every lab's solution: a lab as handed out, some wrong answers of tests/wrong_solutions (all of them, and
every handout, go through the same checks in tests/test_wrong_answers.py), and submissions that cheat or break
things on purpose (see write_submissions). The grader runs on a copy of parlab/ and labs/ (the
kernels import that copy), so the submissions that rewrite the package rewrite the copy; the copy must end the run
byte for byte as it started. A second, short run without the sandbox shows tampering caught and undone where
nothing stops the writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from test_wrong_answers import wrong_answers as _wrong_answers

from parlab.grading import markers, official
from parlab.grading.isolation import Sandbox

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
WRONG = Path(__file__).resolve().parent / "wrong_solutions"
TIMEOUT = 20

SOLUTIONS = sorted((LABS / "solutions").glob("lab*.ipynb"))
MAX_POINTS = {name: lab.max_points for name, lab in official.load_labs().items()}
# The wrong answers graded end to end here (a fresh kernel each: ~12 s of CPU); tests/test_wrong_answers.py runs
# every wrong answer and every handout through the same checks in one process.
GRADED_WRONG = ("lab02_tensor_parallel", "lab_bug_hunt")
# The solutions graded end to end here: those whose checks do what only the grader's setting can break (a sandbox
# with one writable folder: lab 06's disk offload; the timeouts of the longest checks: labs 03, 09, 11 and the bug
# hunt; lab 00's message-by-message ring check). Every other solution's verdict lines are its answer key, which
# nbval re-executes and compares in CI (labs/solutions/ is a test path): the grader scores exactly those lines.
GRADED_SOLUTIONS = ("lab00_ring_allreduce", "lab03_pipeline_1f1b", "lab06_offload", "lab09_expert_parallel",
                    "lab11_fault_tolerance", "lab_bug_hunt")  # fmt: skip

pytestmark = pytest.mark.slow  # one grading run of a class, ~4 min on 2 cores: leave out with -m "not slow"


# ------------------------------------------------------------------------------------------- the submissions


def _notebook(path: Path):
    return nbformat.read(path, as_version=4)


def _with_answers(nb, answers: dict[str, str]):
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    for cell in nb.cells:
        name = markers.answer_name(cell)
        if name in answers:
            cell.source = f"# ANSWER: {name}\n{answers[name]}"
    return nb


REDEFINED_CHECKS = """
import parlab
import parlab.core.check
from parlab.grading import labs as grading
from parlab.grading.labs import lab03_pipeline_1f1b as lab_checks


def _always_pass(what, *args, **kwargs):
    print(f"{what}: PASS")


parlab.compare = parlab.core.check.compare = parlab.check_equal = parlab.core.check.check_equal = _always_pass
lab_checks.compare = lab_checks.check_equal = _always_pass
lab_checks.run = lambda check, *answers: print(f"{check}: PASS")
grading.run_check = lambda *args, **kwargs: None


def capped_orders(p, m, k):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]  # GPipe, no cap
"""

TAMPER = """
from pathlib import Path

import parlab

package = Path(parlab.__file__).parent
for path in [*package.parent.joinpath("labs").rglob("*.ipynb"), *package.rglob("*.py")]:
    try:  # every verdict a PASS, every judge a pushover
        text = path.read_text().replace("FAIL", "PASS")
        if path.name.startswith("lab0") and path.suffix == ".py":
            text += "\\n\\ndef judge(*args):\\n    return ['everything: PASS']\\n"
        path.write_text(text)
    except OSError as error:
        print("blocked:", error)
try:
    (package / "grading" / "planted.py").write_text("x = 1\\n")
except OSError as error:
    print("blocked:", error)


def reduce_scatter_phase(chunks):
    raise NotImplementedError
"""

KILL_PARENT = """
import os
import signal

os.kill(os.getppid(), signal.SIGKILL)  # the process that runs this kernel
"""

IGNORE_INTERRUPT = """
import signal
import time

signal.signal(signal.SIGINT, signal.SIG_IGN)
while True:  # (asleep rather than spinning: a spinning cell would take a core from the rest of the run)
    time.sleep(0.05)
"""

LIBRARY_ALL_REDUCE = """
def reduce_scatter_phase(pieces, owner, ring, touched):
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    x = torch.cat(pieces)
    dist.all_reduce(x)  # the library's all-reduce ...
    owned = {q: [k for k, o in enumerate(owner) if o == q] for q in ring}
    for s in range(P - 1):  # ... and padding traffic of the ring's sizes, on the ring
        out, into = owned[ring[(m - s - 1) % P]], owned[ring[(m - s - 2) % P]]
        works = [comm.isend(torch.cat([pieces[k] for k in out]), ring[(m + 1) % P])] if out else []
        if into:
            incoming = x.new_empty(sum(pieces[k].numel() for k in into))
            works.append(comm.irecv(incoming, ring[m - 1]))
        comm.wait_all(works)
    for piece, total in zip(pieces, x.split([p.numel() for p in pieces])):
        piece.copy_(total)
"""

LIBRARY_BIDIRECTIONAL = """
def bidirectional_all_reduce(x):
    P, r = dist.get_world_size(), dist.get_rank()
    total = x.clone()
    dist.all_reduce(total)  # the library's all-reduce ...
    halves = [c.tensor_split(2) for c in x.tensor_split(P)]
    for s in range(2 * (P - 1)):  # ... and padding traffic of the two rings' sizes, both ways
        c, d = (r - 1 - s) % P, (r + 1 + s) % P
        a, b = torch.empty_like(halves[(c - 1) % P][0]), torch.empty_like(halves[(d + 1) % P][1])
        works = [comm.isend(halves[c][0], (r + 1) % P), comm.irecv(a, (r - 1) % P)]
        comm.wait_all(works + [comm.isend(halves[d][1], (r - 1) % P), comm.irecv(b, (r + 1) % P)])
    return total
"""

SIZE_MISMATCH = """
def reduce_scatter_phase(pieces, owner, ring, touched):
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]
    owned = {q: [k for k, o in enumerate(owner) if o == q] for q in ring}
    for s in range(P - 1):
        out, into = owned[ring[(m - s - 1) % P]], owned[ring[(m - s - 2) % P]]
        sizes = [pieces[k].numel() for k in into]
        works = []
        if out:
            message = torch.cat([pieces[k] for k in out])
            message = torch.cat([message, message]) if r == 0 else message  # rank 0 sends twice too much
            works.append(comm.isend(message, right))
        if into:
            incoming = pieces[into[0]].new_empty(sum(sizes))
            works.append(comm.irecv(incoming, left))
        comm.wait_all(works)
        for k, part in zip(into, incoming.split(sizes) if into else []):
            pieces[k] += part
"""


def _sleep_forever_after(source: str) -> str:
    loop = "while True:  # stopped by the interrupt: the class above is defined\n    time.sleep(0.05)\n"
    return f"{source}\n\nimport time\n\n{loop}"


def write_submissions(folder: Path) -> dict[str, dict]:
    """Every submission of the run: {file stem: what the test expects of it}."""
    cases = {}

    def add(stem: str, nb, **expect):
        path = folder / f"{stem}.ipynb"
        if isinstance(nb, str):
            path.write_text(nb)
        else:
            nbformat.write(nb, path)
        cases[stem] = {"path": path, **expect}

    handout = {s.stem: _notebook(LABS / s.name) for s in SOLUTIONS}
    solution_nb = {s.stem: _notebook(s) for s in SOLUTIONS}
    # First, so that its time is measured while the run is young: a cell that ignores the interrupt.
    ignores = _with_answers(handout["lab03_pipeline_1f1b"], {"capped_bubble": IGNORE_INTERRUPT})  # its first cell
    add("lab03_ignores_interrupt", ignores, kind="cheat")
    for solution in SOLUTIONS:
        if solution.stem in GRADED_SOLUTIONS:
            add(solution.stem, solution_nb[solution.stem], kind="solution")
        if solution.stem in GRADED_WRONG:  # every wrong answer and handout: tests/test_wrong_answers.py
            answers, failing = _wrong_answers(WRONG / f"{solution.stem}.py")
            wrong = _with_answers(solution_nb[solution.stem], answers)
            add(f"{official.lab_key(solution.stem)}_wrong", wrong, kind="wrong", fail=failing)
    # Lab 03's handout for the cheats that answer nothing: its checks need no ranks, so they cost little.
    add(
        "redefined_checks",
        _with_answers(handout["lab03_pipeline_1f1b"], {"capped": REDEFINED_CHECKS}),
        kind="cheat",
    )
    for stem, where in [("own_key_absolute", "absolute"), ("own_key_relative", "relative")]:
        nb = _notebook(LABS / "lab03_pipeline_1f1b.ipynb")  # the handout, answered with nothing ...
        solved = _notebook(LABS / "solutions" / "lab03_pipeline_1f1b.ipynb")
        handed = [cell for cell in solved.cells if not markers.solution_only(cell)]  # as the handout has them
        for cell, solution_cell in zip(nb.cells, handed, strict=True):
            if markers.check_marker(cell):  # ... but with every verdict a stored PASS: its own answer key
                cell.outputs = solution_cell.outputs
        own = folder / stem
        nb.metadata["parlab"]["lab"] = str(own) if where == "absolute" else os.path.relpath(own, LABS / "solutions")
        for cell in nb.cells:
            if markers.check_marker(cell):
                cell.source = re.sub(r"\(\d+ points?\)", "(500 points)", cell.source, count=1)
        add(stem, nb, kind="cheat")
    add("lab00_tamper", _with_answers(handout["lab00_ring_allreduce"], {"reduce_scatter": TAMPER}), kind="cheat")
    add("lab00_untouched", handout["lab00_ring_allreduce"], kind="cheat")
    kill = _with_answers(solution_nb["lab01_data_parallel"], {})
    for cell in kill.cells:
        if markers.answer_name(cell) == "average":
            cell.source += "\n" + KILL_PARENT
    add("lab01_kills_parent", kill, kind="partial", points=2)  # the shard check ran before the kill
    sleeper = _with_answers(solution_nb["lab02_tensor_parallel"], {})
    for cell in sleeper.cells:
        if markers.answer_name(cell) == "swiglu":
            cell.source = _sleep_forever_after(cell.source)
    add("lab02_interrupted", sleeper, kind="full")
    library = {"reduce_scatter": LIBRARY_ALL_REDUCE, "bidirectional": LIBRARY_BIDIRECTIONAL}
    # Its other answers (hierarchical, the prediction, halving-doubling) are the solution's: they keep their points.
    add(
        "lab00_library_allreduce", _with_answers(solution_nb["lab00_ring_allreduce"], library), kind="partial", points=8
    )
    mismatch = {"reduce_scatter": SIZE_MISMATCH}
    add("lab00_size_mismatch", _with_answers(solution_nb["lab00_ring_allreduce"], mismatch), kind="partial", points=11)
    add("lab00_is_lab01", solution_nb["lab01_data_parallel"], kind="cheat")
    add("lab02_unreadable", '{"cells": [ this is not json', kind="cheat")
    return cases


# ---------------------------------------------------------------------------------------------------- the run


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _package_copy(folder: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints")
    shutil.copytree(ROOT / "parlab", folder / "parlab", ignore=ignore)
    shutil.copytree(LABS, folder / "labs", ignore=ignore)
    return folder


def _grade(copy: Path, paths: list[Path], *options: str) -> tuple[subprocess.CompletedProcess, dict, float]:
    report = copy / f"report-{time.monotonic_ns()}.json"
    env = {**os.environ, "PYTHONPATH": str(copy)}
    command = [sys.executable, "-m", "parlab", "grade", "--report", str(report), *options, *map(str, paths)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=copy, env=env, timeout=1200)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(report.read_text()), seconds


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    copy = _package_copy(tmp_path_factory.mktemp("package"))
    before = {"parlab": _tree(copy / "parlab"), "labs": _tree(copy / "labs")}
    cases = write_submissions(tmp_path_factory.mktemp("submissions"))
    folder = next(iter(cases.values()))["path"].parent
    gradebook = copy / "class" / "grades.csv"
    done, report, seconds = _grade(
        copy, [folder], "--timeout", str(TIMEOUT), "--jobs", "3", "--gradebook", str(gradebook)
    )  # the whole folder, as an instructor grades a class
    print(done.stdout)
    for g in report["notebooks"]:  # where the time went (a check near the timeout on a loaded machine shows here)
        print(f"{Path(g['notebook']).stem}: {g['seconds']:.0f} s, cells {[t[2] for t in g['timings']]}")
    by_stem = {Path(g["notebook"]).stem: g for g in report["notebooks"]}
    after = {"parlab": _tree(copy / "parlab"), "labs": _tree(copy / "labs")}
    return {
        "cases": cases,
        "report": report,
        "grades": by_stem,
        "table": done.stdout,
        "stderr": done.stderr,
        "seconds": seconds,
        "copy": copy,
        "unchanged": before == after,
        "gradebook": gradebook,
    }


def _checks(grade_: dict) -> dict[str, dict]:
    return {c["check"]: c for c in grade_["checks"]}


def test_every_solution_scores_full_marks(graded):
    for stem, case in graded["cases"].items():
        if case["kind"] == "solution":
            g = graded["grades"][stem]
            assert g["max_points"] > 0 and g["points"] == g["max_points"], g


def test_every_cheating_or_broken_submission_scores_zero(graded):
    for stem, case in graded["cases"].items():
        if case["kind"] == "cheat":
            g = graded["grades"][stem]
            assert g["points"] == 0, (stem, g)
            assert g["max_points"] > 0 and g["max_points"] < 100, (stem, g)  # the lab's own points, not the file's


def test_wrong_answers_fail_exactly_the_checks_they_break(graded):
    for stem, case in graded["cases"].items():
        if case["kind"] == "wrong":
            failed = {name for name, c in _checks(graded["grades"][stem]).items() if not c["passed"]}
            assert failed == case["fail"], (stem, graded["grades"][stem]["checks"])
    backward = _checks(graded["grades"]["lab02_wrong"])["vocab_ce"]["detail"]
    assert re.match(r"rank \d failed: .*incorrect number of gradients", backward), backward


def test_a_submission_that_kills_its_parent_keeps_what_it_passed_and_the_run_goes_on(graded):
    g = graded["grades"]["lab01_kills_parent"]
    checks = _checks(g)
    assert checks["shard"]["passed"] and not checks["average"]["passed"] and not checks["training"]["passed"]
    assert g["points"] == 2
    assert graded["table"].rstrip().splitlines()[-2].startswith("TOTAL")


def test_a_cell_that_ignores_the_interrupt_is_killed_within_the_minute(graded):
    g = graded["grades"]["lab03_ignores_interrupt"]
    assert g["seconds"] < 60, g
    assert any("ignored the interrupt" in note for note in g["notes"]), g["notes"]
    assert all("killed" in c["detail"] or "kernel" in c["detail"] for c in g["checks"]), g["checks"]


def test_an_interrupted_answer_cell_is_graded_on(graded):
    g = graded["grades"]["lab02_interrupted"]
    assert g["points"] == g["max_points"] == MAX_POINTS["lab02_tensor_parallel"], g
    assert f"answer cell 'swiglu' timed out after {TIMEOUT} s (interrupted)" in g["notes"]


def test_lab00_with_the_library_all_reduce_fails_every_check_on_the_ring_itself(graded):
    checks = _checks(graded["grades"]["lab00_library_allreduce"])
    for name in ("reduce_scatter", "bidirectional"):
        assert "library collective(s) ['allreduce']" in checks[name]["detail"], checks[name]


def test_a_failing_rank_is_explained_by_its_own_error(graded):
    checks = _checks(graded["grades"]["lab00_size_mismatch"])
    detail = checks["reduce_scatter"]["detail"]
    assert detail.startswith("rank ") and "exited with code" not in detail.split(":", 1)[0], detail
    assert re.search(r"size|match|length", detail, re.I), detail
    assert checks["bidirectional"]["passed"]  # the other answers are the solution's


def test_own_answer_keys_redefined_checks_and_wrong_labs_are_named(graded):
    grades = graded["grades"]
    for stem in ("own_key_absolute", "own_key_relative"):
        assert (
            grades[stem]["lab"] == "lab03_pipeline_1f1b"
            and grades[stem]["max_points"] == MAX_POINTS["lab03_pipeline_1f1b"]
        )
        assert any("unknown lab" in note for note in grades[stem]["notes"]), grades[stem]
    redefined = grades["redefined_checks"]
    assert redefined["lab"] == "lab03_pipeline_1f1b" and redefined["max_points"] == MAX_POINTS["lab03_pipeline_1f1b"]
    wrong_lab = grades["lab00_is_lab01"]
    assert wrong_lab["lab"] == "lab00_ring_allreduce" and wrong_lab["max_points"] == MAX_POINTS["lab00_ring_allreduce"]
    assert "lab01_data_parallel" in wrong_lab["error"], wrong_lab
    unreadable = grades["lab02_unreadable"]
    assert unreadable["max_points"] == MAX_POINTS["lab02_tensor_parallel"] and "unreadable" in unreadable["error"]


def test_no_file_of_the_package_or_the_labs_changed(graded):
    assert graded["unchanged"]  # the copy the kernels imported, which the tampering submission tried to rewrite
    tamper = graded["grades"]["lab00_tamper"]
    if graded["report"]["sandbox"] == "none":
        assert tamper["tampered"], tamper  # the writes happened, were caught and undone


def test_the_run_ends_with_a_table_and_says_whether_it_was_sandboxed(graded):
    table = graded["table"]
    assert "TOTAL" in table and re.search(r"^sandbox: ", table, re.M)
    for stem in graded["cases"]:
        assert stem in table
    assert "WARNING" not in graded["stderr"] and "Kernel" not in graded["stderr"]  # no kernel chatter
    print(f"grading run: {len(graded['cases'])} notebooks in {graded['seconds']:.0f} s, {graded['report']['sandbox']}")


def test_without_the_sandbox_tampering_is_caught_and_undone(tmp_path):
    copy = _package_copy(tmp_path / "package")
    before = {"parlab": _tree(copy / "parlab"), "labs": _tree(copy / "labs")}
    folder = tmp_path / "submissions"
    folder.mkdir()
    handout = _notebook(LABS / "lab00_ring_allreduce.ipynb")
    tamper, untouched = folder / "lab00_tamper.ipynb", folder / "lab00_untouched.ipynb"
    nbformat.write(_with_answers(handout, {"reduce_scatter": TAMPER + "\n" + KILL_PARENT}), tamper)
    nbformat.write(handout, untouched)
    _, report, _ = _grade(copy, [tamper, untouched], "--sandbox", "none", "--timeout", str(TIMEOUT))
    grades = {Path(g["notebook"]).stem: g for g in report["notebooks"]}
    assert report["sandbox"] == "none"
    assert grades["lab00_tamper"]["tampered"] and grades["lab00_tamper"]["points"] == 0
    assert any(path.endswith("planted.py") for path in grades["lab00_tamper"]["tampered"])
    assert grades["lab00_untouched"]["points"] == 0 and not grades["lab00_untouched"]["tampered"]
    assert {"parlab": _tree(copy / "parlab"), "labs": _tree(copy / "labs")} == before


def test_the_sandbox_is_used_where_bwrap_works():
    sandbox = Sandbox("auto")
    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (bash .ci/install-sandbox)")
    assert sandbox.kind == "bwrap", sandbox.reason


def test_a_class_gradebook_has_a_row_per_notebook_and_a_feedback_file_per_student(graded):
    import csv

    from parlab.grading import gradebook

    with open(graded["gradebook"], newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(graded["cases"]) >= 20  # a class of mixed labs
    by_notebook = {Path(row["notebook"]).stem: row for row in rows}
    assert set(by_notebook) == set(graded["cases"])
    for stem, row in by_notebook.items():
        g = graded["grades"][stem]
        assert (int(row["points"]), int(row["max_points"]), row["lab"]) == (g["points"], g["max_points"], g["lab"])
        parts = [part.rsplit(" ", 1)[1].split("/") for part in row["parts"].split("; ") if part]
        assert sum(int(got) for got, _ in parts) == (g["points"] if not g["tampered"] else sum(
            c["points"] for c in g["checks"]))  # fmt: skip
        assert sum(int(most) for _, most in parts) == g["max_points"]
        assert int(row["failed"]) == sum(not c["passed"] for c in g["checks"])
    # The CSV is what the report says, in a fixed order (seconds aside): grading the same class again writes it again.
    folder = next(iter(graded["cases"].values()))["path"].parent
    notebooks = graded["report"]["notebooks"]
    students = [
        gradebook.student_of(Path(g["notebook"]), folder, g["lab"], official.lab_key(g["lab"]), {}) for g in notebooks
    ]
    recomputed = gradebook.rows(notebooks, students, [folder] * len(notebooks))
    assert [{**r, "seconds": ""} for r in rows] == [
        {**{k: str(v) for k, v in r.items()}, "seconds": ""} for r in recomputed
    ]
    assert by_notebook["lab02_wrong"]["student"] == "wrong"
    assert by_notebook["redefined_checks"]["student"] == "redefined_checks"  # no lab prefix: the whole name
    feedback = graded["gradebook"].with_name("grades_feedback")
    assert {p.name for p in feedback.glob("*.md")} == {gradebook.file_name_of(row["student"]) for row in rows}
    wrong = (
        feedback / gradebook.file_name_of("wrong")
    ).read_text()  # every lab's first wrong answer: lab00_wrong, lab01_wrong, ...
    for stem, case in graded["cases"].items():
        if case["kind"] == "wrong" and stem.endswith("_wrong"):
            assert f"## {graded['grades'][stem]['lab']} " in wrong
            for check in case["fail"]:
                assert f"**{check}** (0/" in wrong, (stem, check)
    assert wrong.count("hint:") >= sum(len(c["fail"]) for s, c in graded["cases"].items() if s.endswith("_wrong"))
    # The class at a glance: a summary per lab and check, and one row per student with a column per lab.
    out = graded["gradebook"].parent
    with open(out / "grades_wide.csv", newline="", encoding="utf-8-sig") as f:
        wide = list(csv.DictReader(f))
    assert sorted(r["student"] for r in wide) == sorted({row["student"] for row in rows})
    for r in wide:
        own = [row for row in rows if row["student"] == r["student"]]
        for lab in {row["lab"] for row in own}:
            assert int(r[lab]) == max(int(row["points"]) for row in own if row["lab"] == lab)
    text = (out / "grades_summary.md").read_text()
    for lab in {row["lab"] for row in rows}:
        assert f"| {lab} (/" in text
    assert "Pass rate per check" in text and "<svg" in (out / "grades_summary.html").read_text()


def test_partly_broken_submissions_keep_exactly_the_points_of_what_works(graded):
    partial = {stem: case for stem, case in graded["cases"].items() if case["kind"] == "partial"}
    assert len(partial) >= 3
    for stem, case in partial.items():
        assert graded["grades"][stem]["points"] == case["points"], (stem, graded["grades"][stem]["checks"])
