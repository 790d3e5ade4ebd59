"""The labs: generated from their solutions, each with its checks module, and the grader's parts, without a kernel.

The grading itself (solutions, handouts, wrong answers and cheats, executed in one run) is tests/test_grade_run.py.
"""

import configparser
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook, new_output

import parlab
from parlab.core import comm, probe
from parlab.grading import command, isolation, markers, official, scores
from parlab.grading import labs as grading
from parlab.grading.labs import check_function

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


def test_a_check_cells_points_are_the_same_in_its_header_and_its_metadata():
    """The grader reads the header (`# CHECK: name (N points)`); the cell's metadata says the same, in every handout
    and solution (a student read 2 in one and 3 in the other)."""
    for path in SOLUTIONS + [LABS / s.name for s in SOLUTIONS]:
        for cell in nbformat.read(path, as_version=4).cells:
            marker, meta = markers.check_marker(cell), cell.get("metadata", {}).get("parlab", {})
            if marker and "points" in meta:
                assert meta["points"] == marker[1], f"{path.name}: {marker[0]}: metadata {meta['points']} points"


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


def test_student_version_stores_no_outputs_and_hides_the_solution():
    for solution_path in SOLUTIONS:
        solution = nbformat.read(solution_path, as_version=4)
        student = nbformat.read(LABS / solution_path.name, as_version=4)
        assert student.metadata["parlab"]["lab"] == solution_path.stem
        checks = 0
        handed = [cell for cell in solution.cells if not markers.solution_only(cell)]  # "What you built" stays
        for ours, theirs in zip(student.cells, handed, strict=True):
            if markers.answer_name(theirs):
                assert "BEGIN SOLUTION" not in ours.source and "END SOLUTION" not in ours.source
                handed_out = "# HANDOUT" in theirs.source  # the bug hunt hands out broken code instead
                assert handed_out or "NotImplementedError" in ours.source
            if markers.check_marker(theirs):
                checks += 1
                expected = markers.verdict_lines(theirs.outputs)
                assert expected and all(line.endswith(": PASS") for line in expected), theirs.source[:60]
                assert ours.source == theirs.source
        assert all(not c.outputs for c in student.cells if c.cell_type == "code"), "a handout shows no verdicts"
        assert checks, f"{solution_path.name} has no check cell"


def test_strip_solution_replaces_blocks_with_the_hint():
    source = 'def f(x):\n    y = 1\n    # BEGIN SOLUTION: add "one"\n    y += x\n    # END SOLUTION\n    return y'
    stripped = markers.strip_solution(source)
    assert stripped == (
        'def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError("add \\"one\\"")\n    return y'
    )
    namespace = {}
    exec(stripped, namespace)
    with pytest.raises(NotImplementedError, match='add "one"'):
        namespace["f"](1)
    long_hint = "a hint " * 30
    stripped = markers.strip_solution(f"def f():\n    # BEGIN SOLUTION: {long_hint}\n    pass\n    # END SOLUTION")
    assert max(len(line) for line in stripped.split("\n")) <= markers.HINT_WIDTH
    namespace = {}
    exec(stripped, namespace)
    with pytest.raises(NotImplementedError) as raised:
        namespace["f"]()
    assert str(raised.value) == long_hint.strip()
    for bad in ["# BEGIN SOLUTION\nx", "x\n# END SOLUTION", "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION"]:
        with pytest.raises(ValueError, match="SOLUTION"):
            markers.strip_solution(bad)


def test_masks_are_those_of_the_sanitize_file():
    config = configparser.ConfigParser()
    config.read(ROOT / "tests" / "sanitize.cfg")
    pairs = [(config[s]["regex"], config[s]["replace"]) for s in config.sections()]
    assert [(p.pattern, r) for p, r in markers.MASKS] == pairs


def test_score_lines_rules():
    ok = [new_output("stream", name="stdout", text="a: max |err| 1.1e-16 <= tol 1e-10 (float64): PASS\n")]
    expected = markers.verdict_lines(ok)
    assert expected == ["a: max |err| ERR <= tol 1e-10 (float64): PASS"]
    line = "a: max |err| 2.2e-16 <= tol 1e-10 (float64): PASS"
    assert scores.score_lines("c", 3, [line], expected).points == 3
    assert "differ" in scores.score_lines("c", 3, ["b: measured 1 = theory 1: PASS"], expected).detail
    assert scores.score_lines("c", 3, ["a: ... : FAIL"], expected).detail == "a: ... : FAIL"
    assert scores.score_lines("c", 3, [], expected).detail == "no verdict"
    assert not scores.score_lines("c", 3, [line, line], expected).passed  # more lines than the solution's


# ------------------------------------------------------------------------------- the checks modules (fast)


def test_every_lab_is_on_the_fixed_list_with_a_module_that_collects_and_judges_each_check():
    assert [s.stem for s in SOLUTIONS] == list(grading.LABS)
    for name, lab in official.load_labs().items():
        module = grading.checks_module(name)
        for check, _points in lab.checks:
            assert callable(check_function(module, "collect", check)) and callable(
                check_function(module, "judge", check)
            )
            assert module.STRUCTURAL[check], f"{name}: say what {check} verifies beyond the numbers"
            assert lab.expected[check] and all(line.endswith(": PASS") for line in lab.expected[check])
        assert set(module.STRUCTURAL) == {check for check, _ in lab.checks}
        for cell in lab.solution.cells:  # a check cell is one call into the module, nothing the kernel decides
            if markers.check_marker(cell):
                code = [line for line in cell.source.splitlines()[1:] if line.strip() and not line.startswith("#")]
                assert len(code) == 1 and code[0].startswith("checks.run("), cell.source
    with pytest.raises(KeyError):
        grading.checks_module("../../solutions/lab00_ring_allreduce")


def test_judges_fail_what_is_not_the_answer():
    """The judges compute their reference themselves: data that is not the answer fails, malformed data raises."""
    lab00 = grading.checks_module("lab00_ring_allreduce")
    case = lab00.RS_CASES[0]
    zeros = {"pieces": [torch.zeros(n, dtype=torch.float64) for n in case["sizes"]], "calls": []}
    lines = grading.judge(lab00, "reduce_scatter", {"ranks": [zeros] * len(case["ring"])})
    assert lines and all(line.endswith(": FAIL") for line in lines if "holds" in line or "sent" in line)
    assert any("summed over all ranks" in line and line.endswith(": FAIL") for line in lines), lines
    assert grading.judge(lab00, "reduce_scatter", {"error": "rank 1 failed: boom"}) == [
        "reduce_scatter: the check did not complete (rank 1 failed: boom): FAIL"
    ]
    with pytest.raises((KeyError, TypeError, IndexError)):
        grading.judge(lab00, "reduce_scatter", {"ranks": "all PASS"})
    lab03 = grading.checks_module("lab03_pipeline_1f1b")
    gpipe = [[["F", i] for i in range(8)] + [["B", i] for i in range(8)] for _ in range(4)]
    lines = grading.judge(lab03, "capped", {"orders": {"4,8,2": gpipe, "4,4,1": "nonsense"}})
    assert any("rank 0 holds 8 at once: FAIL" in line for line in lines), lines
    assert lines[-1].startswith("p=4, m=4, k=1") and lines[-1].endswith(": FAIL")


def test_the_probe_sees_library_collectives_and_every_message():
    def rank(x):
        with probe.recording() as calls:
            y = x.clone()
            torch.distributed.all_reduce(y)  # not through parlab.core.comm: seen all the same
            r, P = torch.distributed.get_rank(), torch.distributed.get_world_size()
            incoming = torch.empty(2)
            comm.wait_all([comm.isend(torch.full((2,), float(r)), (r + 1) % P), comm.irecv(incoming, (r - 1) % P)])
        return calls

    calls = parlab.launch(rank, 2, torch.ones(3), echo=False)[0]
    assert probe.library_collectives(calls) == ["allreduce"]
    sends = [c for c in calls if c["op"] == "send"]
    assert [(c["peer"], c["bytes"]) for c in sends] == [(1, 8)] and sends[0]["data"].tolist() == [0.0, 0.0]
    assert probe.total_bytes(calls, "allreduce") == 12


def test_informative_line_picks_the_cause():
    gloo = (
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
        "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 4000 vs 2000. Received data size "
        "doesn't match expected size. Is there a distributed collective mismatch?\nException raised from ...\n"
    )
    assert "doesn't match" in grading.informative_line(gloo)
    traceback = 'Traceback (most recent call last):\n  File "x", line 1\nValueError: first\n\nKeyError: last\n'
    assert grading.informative_line(traceback) == "KeyError: last"
    assert grading.informative_line("all good\n") == ""


# ---------------------------------------------------------------------------- which lab a submission is (fast)


def test_a_submission_is_identified_by_name_from_the_list_never_by_a_path(tmp_path):
    labs = official.load_labs()
    nb = nbformat.read(LABS / "lab01_data_parallel.ipynb", as_version=4)
    assert official.identify(nb, labs) == ("lab01_data_parallel", [])
    for forged in [str(tmp_path / "mine"), "../../../tmp/mine", "lab01_data_parallel.ipynb", 7]:
        nb.metadata["parlab"]["lab"] = forged
        lab, notes = official.identify(nb, labs)
        assert lab == "lab01_data_parallel" and "unknown lab" in notes[0]  # found by its answer cells
    del nb.metadata["parlab"]
    assert official.identify(nb, labs)[0] == "lab01_data_parallel"
    assert official.lab_of_file_name(Path("lab00_alice.ipynb"), labs) == "lab00_ring_allreduce"
    assert official.lab_of_file_name(Path("alice.ipynb"), labs) is None
    assert official.identify(new_notebook(), labs)[0] is None


def test_grade_rejects_bad_input_before_running_anything(tmp_path, capsys):
    assert command.main([str(tmp_path / "missing.ipynb")]) == 2
    assert "no such notebook" in capsys.readouterr().err
    stray = tmp_path / "x.ipynb"
    nbformat.write(new_notebook(), stray)
    assert command.main(["--lab", "lab42_nothing", str(stray)]) == 2
    assert "lab42_nothing" in capsys.readouterr().err


def test_a_notebook_that_is_no_lab_is_reported_without_running_anything(tmp_path):
    stray = tmp_path / "notes.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("print(1)")]), stray)
    from parlab.grading.grader import Grader

    grader = Grader(official.load_labs(), 20, sandbox=None, guard=None)
    result = grader.grade(stray)
    assert result.error.startswith("not a lab") and result.max_points == 0 and not grader.failed


# ------------------------------------------------------------------------------------------- isolation (fast)


def test_tree_guard_reports_and_undoes_every_change(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("a = 1\n")
    (root / "sub" / "b.py").write_text("b = 2\n")
    guard = isolation.TreeGuard([root])
    assert guard.changes() == []
    (root / "a.py").write_text("a = 666\n")
    (root / "sub" / "b.py").unlink()
    (root / "sub" / "planted.py").write_text("evil = True\n")
    (root / "sub").chmod(0o500)
    changed = guard.changes()
    assert sorted(guard.relative(p) for p in changed) == ["pkg/a.py", "pkg/sub/b.py", "pkg/sub/planted.py"]
    guard.restore(changed)
    assert guard.changes() == []
    assert (root / "a.py").read_text() == "a = 1\n" and not (root / "sub" / "planted.py").exists()


def test_kill_tree_finds_descendants_that_left_the_session(tmp_path):
    isolation.become_subreaper()
    token = "test" + str(os.getpid())
    script = (
        "import os, subprocess, sys, time\n"
        "if os.fork() == 0:\n"  # a grandchild in a session of its own, orphaned: adopted by us (subreaper)
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PARLAB_GRADE_TOKEN": token}
    process = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(_with_token(token)) < 2:
        time.sleep(0.1)
    assert len(_with_token(token)) == 2
    try:
        isolation.kill_tree(process, token)
        time.sleep(0.2)
        assert _with_token(token) == []
    finally:
        isolation.become_subreaper(False)  # the rest of this pytest process's tests: orphans go to init again


def _with_token(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if f"PARLAB_GRADE_TOKEN={token}".encode() in environ and state != "Z":
                found.append(int(entry))
    return found


# ------------------------------------------------------------------------------- labs that teach (fast)


def _normalised(text: str) -> str:
    return "".join(text.split())


def _solution_code_lines(source: str) -> list[str]:
    """The code lines inside a cell's solution blocks (not the bug hunt's handed-out part), trailing comments
    removed, whitespace dropped."""
    lines, inside = [], False
    for line in source.split("\n"):
        if markers.BEGIN_RE.match(line):
            inside = True
        elif markers.END_RE.match(line) or markers.HANDOUT_RE.match(line):
            inside = False
        elif inside and line.strip() and not line.strip().startswith("#"):
            code = _without_comment(line.strip())
            lines.append(_normalised(code))
    return lines


def _without_comment(line: str) -> str:
    import io
    import tokenize

    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line
    comments = [t for t in tokens if t.type == tokenize.COMMENT]
    return line[: comments[0].start[1]].rstrip() if comments else line


def _handout_text_and_code(nb) -> tuple[str, str]:
    """(what a student reads as prose: markdown, comments and string literals, hints included; the code the handout
    gives), both with whitespace dropped."""
    import io
    import tokenize

    prose, code = [], []
    for cell in nb.cells:
        if cell.cell_type != "code":
            prose.append(cell.source)
            continue
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(cell.source + "\n").readline))
        except (tokenize.TokenError, IndentationError, SyntaxError):
            prose.append(cell.source)
            continue
        prose += [t.string for t in tokens if t.type in (tokenize.COMMENT, tokenize.STRING)]
        prose += [t.string for t in tokens if t.type == getattr(tokenize, "FSTRING_MIDDLE", -1)]
        code += [_without_comment(line.strip()) for line in cell.source.split("\n")]
    return _normalised("\n".join(prose)), "\n".join(_normalised(line) for line in code)


def test_no_line_of_an_answer_is_in_its_handout_text():
    """Hints guide, never give: no code line (> 20 characters) of a solution's answers appears in the handout's
    markdown, comments or strings (hints included), unless the handout already gives that line as code."""
    for solution_path in SOLUTIONS:
        solution = nbformat.read(solution_path, as_version=4)
        handout = nbformat.read(LABS / solution_path.name, as_version=4)
        prose, given = _handout_text_and_code(handout)
        given_lines = set(given.split("\n"))
        for cell in solution.cells:
            if not markers.answer_name(cell):
                continue
            for line in _solution_code_lines(cell.source):
                if len(line) > 20 and line not in given_lines:
                    assert line not in prose, f"{solution_path.stem}: the handout's text gives away {line!r}"


def test_the_leak_test_catches_a_hint_that_is_the_code():
    cell = "# ANSWER: merge\ndef merge(a, b):\n    # BEGIN SOLUTION: h\n    total = torch.logaddexp(a, b)  # why\n"
    cell += "    # END SOLUTION\n"
    lines = _solution_code_lines(cell)
    assert lines == ["total=torch.logaddexp(a,b)"]
    leaky = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("use `total = torch.logaddexp(a,b)`")])
    assert lines[0] in _handout_text_and_code(leaky)[0]
    stub = nbformat.v4.new_notebook(cells=[new_code_cell('raise NotImplementedError("total = torch.logaddexp(a, b)")')])
    assert lines[0] in _handout_text_and_code(stub)[0]


def test_every_lab_has_three_code_parts_hint_cells_that_fold_and_two_wrong_answers():
    for name, lab in official.load_labs().items():
        predictions = {c.source.split("\n", 1)[0] for c in lab.solution.cells if c.source.startswith("# PREDICT:")}
        assert len(lab.checks) - len(predictions) >= 3, f"{name}: at least three graded code parts"
        checks = {check for check, _ in lab.checks}
        for cell in lab.solution.cells:
            if markers.hint_of(cell) is not None:
                assert markers.hint_of(cell) in checks, f"{name}: a hint cell names no check: {cell.source[:60]}"
                assert cell.metadata.get("jupyter", {}).get("source_hidden") is True, f"{name}: hint not folded"
        wrong = sorted(WRONG.glob(f"{name}*.py"))
        assert len(wrong) >= 2, f"{name}: at least two wrong solutions in tests/wrong_solutions/"


def test_no_hints_handouts_carry_no_hint_cells(tmp_path):
    make_labs = _load_make_labs()
    assert make_labs.main(["--no-hints", "--out", str(tmp_path)]) == 0
    hinted = 0
    for solution_path in SOLUTIONS:
        with_hints = nbformat.read(LABS / solution_path.name, as_version=4)
        without = nbformat.read(tmp_path / solution_path.name, as_version=4)
        hints = [c for c in with_hints.cells if markers.hint_of(c) is not None]
        hinted += bool(hints)
        assert not [c for c in without.cells if markers.hint_of(c) is not None]
        assert len(without.cells) == len(with_hints.cells) - len(hints)
    assert hinted, "no lab has a hint cell"


def test_a_handout_block_hands_out_the_broken_code():
    source = (
        "def average(g, P):\n"
        "    # BEGIN SOLUTION: the gradient comes out P times too large\n"
        "    return g / P\n"
        "    # HANDOUT\n"
        "    # return g\n"
        "    # END SOLUTION\n"
    )
    assert markers.strip_solution(source) == (
        "def average(g, P):\n    # the gradient comes out P times too large\n    return g\n"
    )
    with pytest.raises(ValueError, match="commented"):
        markers.strip_solution("# BEGIN SOLUTION\nx = 1\n# HANDOUT\nx = 2\n# END SOLUTION")


def test_prediction_lines_score_against_the_theory_and_show_all_three():
    lines = grading.prediction_lines("bytes", 6100, 6144, measured=6144, rtol=0.05)
    assert lines == [
        "bytes: predicted 6,100 | theory 6,144 | measured 6,144",
        "bytes: prediction within 5% of theory: PASS",
        "bytes: measured equals theory: PASS",
    ]
    assert grading.prediction_lines("b", 5000, 6144)[1].endswith(": FAIL")
    for bad in ["6144", float("nan"), float("inf"), None, [6144], True]:
        assert grading.prediction_lines("b", bad, 6144)[1].endswith(": FAIL"), bad
    assert grading.prediction_lines("b", torch.tensor(6144), 6144)[1].endswith(": PASS")
    assert grading.prediction_lines("b", 0.0, 0.0)[1].endswith(": PASS")
    assert grading.prediction_lines("b", 1, 1, measured=2)[2].endswith(": FAIL")
    # A right prediction that is not the solution's own number scores: only verdict lines are compared.
    expected = [line for line in grading.prediction_lines("b", 6144, 6144, 6144) if markers.VERDICT_RE.search(line)]
    assert scores.score_lines("p", 2, grading.prediction_lines("b", 6000, 6144, 6144), expected).passed


def test_the_gradebook_names_students_from_folders_then_file_names_then_metadata(tmp_path):
    from parlab.grading import gradebook

    (tmp_path / "alice").mkdir()
    for path in [
        "alice/lab00.ipynb",
        "lab00_bob.ipynb",
        "lab00_ring_allreduce_carol.ipynb",
        "lab00_ring_allreduce.ipynb",
    ]:
        (tmp_path / path).write_text("{}")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "lab00_bob-checkpoint.ipynb").write_text("{}")
    found, skipped = gradebook.notebooks_in([str(tmp_path)])
    assert skipped == []
    assert [p.relative_to(tmp_path).as_posix() for p, _ in found] == [
        "alice/lab00.ipynb",
        "lab00_bob.ipynb",
        "lab00_ring_allreduce.ipynb",
        "lab00_ring_allreduce_carol.ipynb",
    ]
    lab, key = "lab00_ring_allreduce", "lab00"
    names = [gradebook.student_of(p, root, lab, key, {"student": "dave/../x"}) for p, root in found]
    assert names == ["alice", "bob", "dave/../x", "carol"]  # the metadata only where the file name says nothing
    assert gradebook.student_of(tmp_path / "lab_bug_hunt_eve.ipynb", tmp_path, "lab_bug_hunt", "lab_bug_hunt") == "eve"
    assert gradebook.student_of(tmp_path / "lab00_ring_allreduce.ipynb", None, lab, key, {}) == lab


def test_the_gradebook_rows_and_feedback_from_a_report():
    from parlab.grading import gradebook

    def graded(notebook, lab, checks, **extra):
        entries = [
            {"check": c, "passed": p, "points": n if p else 0, "max_points": n, "detail": d} for c, p, n, d in checks
        ]
        points, max_points = sum(e["points"] for e in entries), sum(n for _, _, n, _ in checks)
        base = {"notebook": notebook, "lab": lab, "checks": entries, "notes": [], "error": None, "seconds": 3.14159}
        return {**base, "points": points, "max_points": max_points, **extra}

    grades = [
        graded("/x/lab01_zed.ipynb", "lab01_data_parallel", [("shard", True, 2, ""), ("average", False, 3, "a: FAIL")]),
        graded("/x/lab00_amy.ipynb", "lab00_ring_allreduce", [("reduce_scatter", True, 4, "")]),
        graded("/x/lab00_amy2.ipynb", "lab00_ring_allreduce", [("reduce_scatter", True, 4, "")]),
    ]
    students = ["zed", "amy", "amy"]
    table = gradebook.rows(grades, students, [None] * 3)
    assert [(r["student"], r["lab"], r["points"], r["max_points"], r["failed"]) for r in table] == [
        ("amy", "lab00_ring_allreduce", 4, 4, 0),
        ("amy", "lab00_ring_allreduce", 4, 4, 0),
        ("zed", "lab01_data_parallel", 2, 5, 1),
    ]
    assert table[0]["notes"].startswith("DUPLICATE") and table[2]["parts"] == "shard 2/2; average 0/3"
    text = gradebook.feedback_text(
        "zed", grades[:1], {"lab01_data_parallel": {"average": "**Hint.** Sum, then scale."}}
    )
    assert "**average** (0/3): a: FAIL" in text and "hint: Sum, then scale." in text and "shard" not in text


def test_a_wrong_prediction_is_not_shown_the_answer():
    from parlab.grading.labs import prediction_lines

    wrong = prediction_lines("bytes", 4512, 4576, 4576, rtol=0.005)
    assert "4,576" not in " ".join(wrong) and "4576" not in " ".join(wrong), wrong
    assert wrong[-2].endswith(": FAIL") and "within 0.5% of theory" in wrong[-2]
    right = prediction_lines("bytes", 4570, 4576, 4576, rtol=0.005)
    assert "theory 4" in right[0] and right[-2].endswith(": PASS") and right[-1].endswith(": PASS")


def test_the_graders_feedback_shows_a_wrong_predictions_numbers():
    """Once the grader decides the grade (judge(..., graded=True)), the feedback shows what should have come."""
    import types

    from parlab.grading.labs import judge, prediction_lines

    lab = types.SimpleNamespace(judge_bytes=lambda data: prediction_lines("bytes", data, 4576, 4576, rtol=0.005))
    graded = judge(lab, "bytes", 4512, graded=True)
    assert graded[0] == "bytes: predicted 4,512 | theory 4,576 | measured 4,576" and graded[1].endswith(": FAIL")
    assert "predicted 4,512, theory 4,576: FAIL" in graded[1]  # on the verdict line: what the feedback keeps
    detail = scores.score_lines("bytes", 2, graded, ["bytes: prediction within 0.5% of theory: PASS"]).detail
    assert "predicted 4,512, theory 4,576" in detail, detail
    assert "4,576" not in " ".join(judge(lab, "bytes", 4512))  # the student's own run: still hidden
    assert "4,576" not in " ".join(prediction_lines("bytes", 4512, 4576, 4576, rtol=0.005))  # the flag was reset


def test_lab06s_judge_accounts_bytes_as_the_library_does():
    """Lab 06's judge computes device and host bytes of any placement itself; at the placements the library has
    (ZeRO-2 on the device, ZeRO-Offload's host), they equal parlab.schemes.zero.theory.offload_memory's."""
    from parlab.grading.labs import lab06_offload

    assert lab06_offload.library_accounting_agrees()


def test_lab07_every_right_plan_gets_the_solutions_pass_line():
    """The grader compares PASS lines with the solution's: a plan with another number of micro-batches within the
    bubble's bound (the handout: any will do) must read the same (a trial student lost 5 points to this)."""
    from parlab.grading.labs import lab07_hybrid as lab07
    from parlab.grading.labs.lab07_layout import MAX_BUBBLE, best_plan, busiest, pipeline_bubble

    tried = 0
    for cfg, world, budget in lab07.PLAN_CASES:
        best = best_plan(world, budget, cfg)
        if best is None:
            continue
        axes, zero = best
        sent, held = busiest(cfg, axes, zero)
        rows = lab07.B // axes["dp"]
        ms = [m for m in range(1, rows + 1) if rows % m == 0 and pipeline_bubble(axes["pp"], m) <= MAX_BUBBLE]
        lines = set()
        for m in ms:
            plan = {"axes": axes, "zero": zero, "microbatches": m, "held": held, "sent": sent}
            lines.add(lab07.plan_line(cfg, world, budget, {**plan, "bubble": pipeline_bubble(axes["pp"], m)}))
        assert len(lines) == 1 and next(iter(lines)).endswith(": PASS"), lines
        tried += len(ms) > 1
    assert tried, "no case where two numbers of micro-batches are both right"


def _solutions_verdicts(name: str, check: str) -> tuple[list[str], int]:
    """The solution's stored verdict lines of `check` (masked, as the grader compares them) and its points."""
    lab = official._official_lab(name, nbformat.read(LABS / "solutions" / f"{name}.ipynb", as_version=4))
    return lab.expected[check], dict(lab.checks)[check]


def test_lab11_every_right_interval_gets_the_solutions_pass_lines():
    """The grader compares PASS lines with the solution's: another interval within 1% of the least loss (Young's,
    Daly's, a search: all right), with another prediction within 2% of its measured loss, must read the same lines
    and score full marks against the stored solution."""
    from parlab.grading.labs import lab11_fault_tolerance as lab11

    near, far = [], []
    for cluster in lab11.CLUSTERS:
        best_tau, best = lab11._measured_best(cluster)
        taus = torch.tensor([best_tau * f for f in (0.9, 1.1, 0.95, 1.05)], dtype=torch.float64)
        lost = lab11.simulate(*cluster, taus)
        i = next(i for i in range(len(taus)) if lost[i] <= best * (1 + lab11.SIM_SLACK / 2))  # a clear margin
        near.append((best_tau, best * 0.995))
        far.append((float(taus[i]), float(lost[i]) * 1.01))
    lines = [lab11.judge_checkpoint_cost({"answers": answers, "library": []}) for answers in (near, far)]
    verdicts = [[markers.mask(line) for line in got if markers.VERDICT_RE.search(line)] for got in lines]
    assert verdicts[0] == verdicts[1] and all(line.endswith(": PASS") for line in verdicts[0]), verdicts
    expected, points = _solutions_verdicts("lab11_fault_tolerance", "checkpoint_cost")
    for got in lines:
        result = scores.score_lines("checkpoint_cost", points, got, expected)
        assert result.passed, result.detail
