"""The labs: generated from their solutions, graded by re-execution, and the grading tells right from wrong.

Each notebook execution costs a few seconds, so the grading tests run each notebook once: every solution (full
points), every untouched student notebook (0 points), every wrong solution in tests/wrong_solutions (its bug
caught by the checks it names; lab02's crashes the ranks), and a small synthetic lab for hangs, dead kernels and
tampered check cells.
"""

import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from parlab import grade

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
SOLUTIONS = sorted((LABS / "solutions").glob("lab*.ipynb"))
WRONG = Path(__file__).resolve().parent / "wrong_solutions"


def _load_make_labs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_labs", LABS / "make_labs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- generation (fast)


def test_there_are_labs_and_each_has_a_student_version_and_a_wrong_solution():
    assert SOLUTIONS, "no lab in labs/solutions"
    for solution in SOLUTIONS:
        assert (LABS / solution.name).exists(), f"labs/{solution.name} missing: run python labs/make_labs.py"
        assert (WRONG / f"{solution.stem}.py").exists(), f"tests/wrong_solutions/{solution.stem}.py missing"


def test_student_notebooks_are_what_the_solutions_generate():
    make_labs = _load_make_labs()
    for solution in SOLUTIONS:
        assert (LABS / solution.name).read_text() == make_labs.generate(solution), (
            f"labs/{solution.name} is stale: run python labs/make_labs.py"
        )


def test_student_version_keeps_expected_outputs_and_hides_the_solution():
    for solution_path in SOLUTIONS:
        solution = nbformat.read(solution_path, as_version=4)
        student = nbformat.read(LABS / solution_path.name, as_version=4)
        assert student.metadata["parlab"]["lab"] == solution_path.stem
        checks = 0
        for ours, theirs in zip(student.cells, solution.cells, strict=True):
            if grade.answer_name(theirs):
                assert "BEGIN SOLUTION" not in ours.source and "NotImplementedError" in ours.source
            if grade.check_marker(theirs):
                checks += 1
                expected = grade.verdict_lines(theirs.outputs)
                assert expected and all(line.endswith(": PASS") for line in expected), theirs.source[:60]
                assert ours.source == theirs.source and ours.outputs == theirs.outputs
        assert checks, f"{solution_path.name} has no check cell"


def test_strip_solution_replaces_blocks_with_the_hint():
    source = 'def f(x):\n    y = 1\n    # BEGIN SOLUTION: add "one"\n    y += x\n    # END SOLUTION\n    return y'
    stripped = grade.strip_solution(source)
    assert stripped == (
        'def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError("add \\"one\\"")\n    return y'
    )
    namespace = {}
    exec(stripped, namespace)
    with pytest.raises(NotImplementedError, match='add "one"'):
        namespace["f"](1)
    long_hint = "a hint " * 30
    stripped = grade.strip_solution(f"def f():\n    # BEGIN SOLUTION: {long_hint}\n    pass\n    # END SOLUTION")
    assert max(len(line) for line in stripped.split("\n")) <= grade.HINT_WIDTH
    namespace = {}
    exec(stripped, namespace)
    with pytest.raises(NotImplementedError) as raised:
        namespace["f"]()
    assert str(raised.value) == long_hint.strip()
    for bad in ["# BEGIN SOLUTION\nx", "x\n# END SOLUTION", "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION"]:
        with pytest.raises(ValueError, match="SOLUTION"):
            grade.strip_solution(bad)


def test_masks_are_those_of_the_sanitize_file():
    config = configparser.ConfigParser()
    config.read(ROOT / "tests" / "sanitize.cfg")
    pairs = [(config[s]["regex"], config[s]["replace"]) for s in config.sections()]
    assert [(p.pattern, r) for p, r in grade.MASKS] == pairs


def test_score_check_rules():
    ok = [new_output("stream", name="stdout", text="a: max |err| 1.1e-16 <= tol 1e-10 (float64): PASS\n")]
    expected = grade.verdict_lines(ok)
    assert expected == ["a: max |err| ERR <= tol 1e-10 (float64): PASS"]
    assert grade.score_check("c", 3, ok, expected, None).points == 3
    other = [new_output("stream", name="stdout", text="b: measured 1 = theory 1: PASS\n")]
    assert "differ" in grade.score_check("c", 3, other, expected, None).detail
    failed = [new_output("stream", name="stdout", text="a: ... : FAIL\n")]
    assert grade.score_check("c", 3, failed, expected, None).detail == "a: ... : FAIL"
    assert grade.score_check("c", 3, [], expected, None).detail == "printed no verdict line"
    assert "timed out" in grade.score_check("c", 3, ok, expected, 5.0).detail
    error = [new_output("error", ename="RankError", evalue="rank 1 failed; x\n  tb\nValueError: boom", traceback=[])]
    assert grade.score_check("c", 3, ok + error, expected, None).detail == "rank 1 failed; x ValueError: boom"


# ---------------------------------------------------------------------------------------- grading (executes)


def test_grade_gives_full_points_to_solutions_and_zero_to_untouched_labs():
    """The instructor's command, as CI runs it: solutions full marks, the notebooks as handed out 0 points, even
    though the latter store the passing verdicts as outputs (the grade comes from re-execution only)."""
    students = [LABS / s.name for s in SOLUTIONS]
    command = [sys.executable, "-m", "parlab", "grade", "--json", "--jobs", "2", *map(str, SOLUTIONS + students)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 1, done.stderr  # 1: not every check passed (the student versions)
    report = json.loads(done.stdout)
    by_path = {Path(g["notebook"]).resolve(): g for g in report["notebooks"]}
    for path in SOLUTIONS:
        g = by_path[path]
        assert g["error"] is None and g["max_points"] > 0
        assert g["points"] == g["max_points"], [c for c in g["checks"] if not c["passed"]]
    for path in students:
        g = by_path[path]
        assert g["points"] == 0 and g["max_points"] > 0
        assert all("NotImplementedError" in c["detail"] for c in g["checks"]), g["checks"]
    assert report["points"] == sum(by_path[p]["max_points"] for p in SOLUTIONS)


def _wrong_answers(path: Path) -> tuple[dict[str, str], set[str]]:
    """The answer cells of a wrong-solution file (split at '# ANSWER: name' lines) and the checks it must fail."""
    text = path.read_text()
    expect = re.search(r"^# EXPECT FAIL: (.+)$", text, re.M)
    assert expect, f"{path.name} says nothing about which checks must fail"
    parts = re.split(r"^(?=# ANSWER: )", text, flags=re.M)[1:]
    answers = {grade.ANSWER_RE.match(p.split("\n", 1)[0])["name"]: p.strip() for p in parts}
    return answers, {name.strip() for name in expect[1].split(",")}


def test_each_wrong_solution_is_caught(tmp_path, capsys):
    submissions = {}
    for solution_path in SOLUTIONS:
        answers, expected_failures = _wrong_answers(WRONG / f"{solution_path.stem}.py")
        nb = nbformat.read(solution_path, as_version=4)  # the solution's answers, then the wrong ones
        names = {grade.answer_name(c) for c in nb.cells} - {None}
        assert set(answers) <= names, f"{solution_path.stem}: unknown answer cells {set(answers) - names}"
        for cell in nb.cells:
            if grade.answer_name(cell) in answers:
                cell.source = answers[grade.answer_name(cell)]
        path = tmp_path / f"{solution_path.stem}_wrong.ipynb"
        nbformat.write(nb, path)
        submissions[path] = expected_failures
    report, checks = _grade(capsys, LABS / "solutions", list(submissions), grade.DEFAULT_TIMEOUT, jobs=2)
    for path, expected_failures in submissions.items():
        failed = {name for name, c in checks[path.stem].items() if not c["passed"]}
        assert failed == expected_failures, checks[path.stem]
        assert report[path.stem]["points"] < report[path.stem]["max_points"]
    # lab02's wrong backward raises on the ranks: the check shows which rank failed, and autograd's complaint
    backward = checks["lab02_tensor_parallel_wrong"]["backward"]["detail"]
    assert re.match(r"rank \d failed; .*invalid gradient at index 1", backward), backward


# --------------------------------------------------------------------------- hangs, crashes and dead kernels


def _lab(cells: list[str], outputs: dict[int, str]):
    nb = new_notebook(cells=[new_code_cell(source) for source in cells])
    nb.metadata["parlab"] = {"lab": "lab99_robust"}
    for index, text in outputs.items():
        nb.cells[index].outputs = [new_output("stream", name="stdout", text=text)]
    return nb


def _with_answers(nb, answers: dict[str, str]):
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    for cell in nb.cells:
        if grade.answer_name(cell) in answers:
            cell.source = f"# ANSWER: {grade.answer_name(cell)}\n{answers[grade.answer_name(cell)]}"
    return nb


def _write_lab(folder: Path, name: str, cells: list[str], outputs: dict[int, str], submissions: dict) -> list[Path]:
    """A small lab (its solution in folder/solutions) and one submission per entry of `submissions`."""
    nb = _lab(cells, outputs)
    nb.metadata["parlab"]["lab"] = name
    (folder / "solutions").mkdir(exist_ok=True)
    nbformat.write(nb, folder / "solutions" / f"{name}.ipynb")
    paths = []
    for stem, answers in submissions.items():
        paths.append(folder / f"{stem}.ipynb")
        nbformat.write(_with_answers(nb, answers), paths[-1])
    return paths


def _grade(capsys, solutions: Path, paths: list[Path], timeout: float, jobs: int = 1) -> tuple[dict, dict]:
    """Grade with `parlab grade --json` (in this process); returns ({stem: notebook}, {stem: {check: result}})."""
    options = ["--json", "--timeout", str(timeout), "--jobs", str(jobs), "--solutions", str(solutions)]
    args = grade.build_parser(grade.argparse.ArgumentParser()).parse_args([*options, *map(str, paths)])
    assert grade.run(args) == 1
    report = {Path(g["notebook"]).stem: g for g in json.loads(capsys.readouterr().out)["notebooks"]}
    return report, {name: {c["check"]: c for c in g["checks"]} for name, g in report.items()}


def test_hangs_and_dead_kernels_fail_their_checks_and_grading_goes_on(tmp_path, capsys):
    cells = [
        "import os, time",
        "# ANSWER: top\n# BEGIN SOLUTION\nx = 2\n# END SOLUTION",
        "# CHECK: x (2 points)\nprint('x is 2:', 'PASS' if x == 2 else 'FAIL')",
        "# ANSWER: loop\n# BEGIN SOLUTION\ny = 3\n# END SOLUTION",
        "# CHECK: after (1 point)\nprint('after:', 'PASS' if x == 2 else 'FAIL')",
    ]
    submissions = {
        "loop": {"loop": "while True:\n    time.sleep(0.05)"},  # runs past the timeout: interrupted, goes on
        "dies": {"top": "os._exit(1)"},  # kills the kernel: the remaining checks fail
        "right": {},  # graded after the dead kernel
        "tampered": {"top": "x = 5"},  # wrong, and its check cells below are rewritten to print PASS
    }
    paths = _write_lab(tmp_path, "lab99_hang", cells, {2: "x is 2: PASS\n", 4: "after: PASS\n"}, submissions)
    tampered = nbformat.read(paths[-1], as_version=4)
    for cell in tampered.cells:
        if grade.check_marker(cell):
            cell.source = cell.source.split("\n")[0] + "\nprint('x is 2: PASS')"
    nbformat.write(tampered, paths[-1])
    report, checks = _grade(capsys, tmp_path / "solutions", paths, 3)
    assert checks["loop"]["x"]["passed"] and checks["loop"]["after"]["passed"]
    assert report["loop"]["notes"] == ["answer cell 'loop' timed out after 3 s (interrupted)"]
    assert not checks["dies"]["x"]["passed"] and not checks["dies"]["after"]["passed"]
    assert "kernel died" in checks["dies"]["after"]["detail"]
    assert report["right"]["points"] == report["right"]["max_points"] == 3
    assert report["tampered"]["points"] == 0  # the official check cells ran, not the submission's


def test_grade_rejects_bad_input_before_running_anything(tmp_path, capsys):
    assert grade.main([str(tmp_path / "missing.ipynb")]) == 2
    assert "no such notebook" in capsys.readouterr().err
    stray = tmp_path / "lab42_nothing.ipynb"
    nbformat.write(new_notebook(), stray)
    result = grade.grade_notebook(stray)
    assert result.error.startswith("ValueError: no solution for lab 'lab42_nothing'") and result.max_points == 0


def test_a_renamed_submission_without_metadata_finds_its_lab():
    solution = grade.load_solution("lab00_alice", LABS / "solutions")  # e.g. lab00_alice.ipynb, metadata lost
    assert solution.metadata["parlab"]["lab"] == "lab00_ring_allreduce"
