"""`python -m parlab doctor`: the machine, a launch's phases, every scheme at the largest world the machine allows.

The world sizes it picks, its tables and its JSON are checked on their own (fast); one real `doctor --quick` runs
every scheme on this CPU-only machine (gloo, 4 ranks) and must pass in under 2 minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_in_process import run_cli

from parlab import doctor
from parlab.runs import registry as runs
from parlab.runs.registry import all_schemes

COLUMNS = ["scheme", "backend", "world", "device", "passed", "max |err|", "twin", "seconds"]


def test_the_world_sizes_tried_are_every_gpu_first_then_gloos_four():
    assert doctor.worlds_to_try(0) == [4, 3, 2, 1]  # no GPU: gloo at 4 ranks
    assert doctor.worlds_to_try(1) == [1, 4, 3, 2]  # one GPU: NCCL at 1, then gloo for what refuses 1 rank
    assert doctor.worlds_to_try(2) == [2, 1, 4, 3]
    assert doctor.worlds_to_try(8) == [8, 7, 6, 5, 4, 3, 2, 1]  # eight GPUs: NCCL all the way down


def test_a_scheme_that_refuses_one_rank_per_gpu_gets_fewer_or_gloo():
    schemes = all_schemes()
    world, options, refused = doctor.choose_world(schemes["megatron-sp"], gpus=1, quick=True)
    assert world == 4 and options == dict(schemes["megatron-sp"].quick)
    assert refused == [f"refuses world 1: {_refusal('megatron-sp', 1, options)}"]
    world, _, refused = doctor.choose_world(schemes["tp"], gpus=8, quick=False)  # 4 heads: 8 ranks are too many
    assert world == 4 and [r.split(":")[0] for r in refused] == [f"refuses world {w}" for w in (8, 7, 6, 5)]
    assert doctor.choose_world(schemes["collectives"], gpus=0, quick=False) == (4, {}, [])


def _refusal(name: str, world: int, options: dict) -> str:
    with pytest.raises(ValueError) as refused:
        all_schemes()[name].make_options(world_size=world, **options)
    return str(refused.value)


def test_every_schemes_quick_run_is_valid_where_the_doctor_runs_it():
    for name, scheme in all_schemes().items():
        assert dict(scheme.quick).get("steps") == 1, name  # the fastest run: one step
        assert doctor.choose_world(scheme, gpus=0, quick=True)[0] == 4, name


def _row(**changes) -> doctor.SchemeRow:
    row = doctor.SchemeRow("dp", "gloo", 4, "cpu", True, 5.6e-17, "PASS", 2.81)
    for key, value in changes.items():
        setattr(row, key, value)
    return row


def test_the_scheme_table_has_one_aligned_row_per_scheme_and_the_notes_below():
    rows = [_row(), _row(scheme="ring-zigzag", twin="SKIPPED", notes=["twin skipped: torch said no"])]
    lines = doctor.scheme_lines(rows)
    assert lines[0].split() == ["scheme", "backend", "world", "device", "passed", "max", "|err|", "twin", "seconds"]
    starts = [lines[0].index(c) for c in COLUMNS]
    expected = [
        ["dp", "gloo", "4", "cpu", "PASS", "5.6e-17", "PASS", "2.8"],
        ["ring-zigzag", "gloo", "4", "cpu", "PASS", "5.6e-17", "SKIPPED", "2.8"],
    ]
    for line, cells in zip(lines[1:3], expected, strict=True):
        assert [line[s:].split()[0] for s in starts] == cells, line  # every cell under its column's title
    assert lines[3:] == ["notes:", "  ring-zigzag: twin skipped: torch said no"]


def test_a_failed_twin_fails_the_doctor_a_skipped_one_does_not():
    assert doctor.row_passed(_row(twin="SKIPPED")) and doctor.row_passed(_row(twin="-"))
    assert not doctor.row_passed(_row(twin="FAIL"))
    assert not doctor.row_passed(_row(passed=False))


def _timing(launch: str, backend: str, total: float, world: int = 1) -> doctor.LaunchTiming:
    return doctor.LaunchTiming(launch, backend, world, None, 0.01, None, 0.02, 0.001, total, 0, True)


def test_the_launch_goals_are_read_from_the_timings():
    assert doctor.launch_goals([_timing("warm", "gloo", 0.04)]) == []  # no GPU: no goal to measure
    goals = doctor.launch_goals(
        [_timing("warm", "gloo", 0.04), _timing("first on the GPU", "nccl", 6.0), _timing("warm", "nccl", 0.1)]
    )
    assert goals[0].startswith("warm NCCL launch at world 1: 0.100 s = 2.5 x warm gloo (0.040 s)") and "met" in goals[0]
    assert goals[1].endswith("goal < 5 s: NOT met")


def test_bad_options_are_refused_before_any_process_starts(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(doctor, "launch_timings", no_launch)
    monkeypatch.setattr(runs, "launch", no_launch)
    out = run_cli("doctor", "--only", "dp", "nope")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"parlab: error: --only nope: no such scheme; available: {', '.join(all_schemes())}"
    ]
    out = run_cli("doctor", "--world", "2")
    assert out.returncode == 2 and out.stderr.startswith("parlab: error: unrecognized arguments: --world 2")
    out = run_cli("doctor", "--json-file", "/no/such/folder/doctor.json")
    assert out.returncode == 2
    assert out.stderr.strip() == "parlab: error: --json-file /no/such/folder/doctor.json: its folder does not exist"


def test_json_holds_the_machine_the_launch_phases_and_one_row_per_scheme():
    out = run_cli("doctor", "--json", "--quick", "--only", "collectives", "ps")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)  # stdout is the JSON alone (progress goes to stderr)
    assert set(report) == {"machine", "quick", "launch", "launch_goals", "schemes", "passed", "seconds"}
    machine = report["machine"]
    assert machine["gloo"] is True and machine["cpus"] >= 1 and machine["torch"].split("+")[0] in out.stdout
    assert machine["sandbox"] in ("bwrap", "none") and machine["sandbox_detail"]
    launches = {(t["launch"], t["backend"]): t for t in report["launch"]}
    cold, warm = launches[("cold: new rank server", "gloo")], launches[("warm", "gloo")]
    assert cold["server_start"] > 0 and warm["server_start"] is None
    for timing in (cold, warm):
        assert timing["ok"] and 0 < timing["rank_start"] < timing["total"] and timing["process_group"] > 0
        assert timing["cuda_context"] is None  # gloo: no CUDA anywhere
    assert launches[("warm, spares", "gloo")]["spares"] == 1  # served by the spare prepared ahead
    rows = {r["scheme"]: r for r in report["schemes"]}
    assert list(rows) == ["collectives", "ps"] and report["passed"] is True and report["quick"] is True
    for row in rows.values():
        assert row["backend"] == "gloo" and row["world"] == 4 and row["device"] == "cpu" and row["passed"]
        assert 0 <= row["max_abs_err"] <= 1e-10 and row["options"] == {"steps": 1}
    assert rows["collectives"]["twin"] == "PASS" and rows["ps"]["twin"] == "SKIPPED"


def test_a_failing_scheme_is_a_failed_row_and_a_failed_doctor(monkeypatch):
    from parlab.runtime.errors import RankError

    def broken(name, **kwargs):
        raise RankError(1, "Traceback (most recent call last):\nValueError: broken on purpose\n", "", "")

    monkeypatch.setattr(doctor, "launch_timings", lambda gpus: [])  # (the launch is not under test here)
    monkeypatch.setattr(runs, "launch_scheme", broken)
    out = run_cli("doctor", "--only", "collectives", "ps")
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["collectives"], ["ps"])}
    assert rows["collectives"][1:] == ["gloo", "4", "-", "FAIL", "-", "-", rows["collectives"][-1]]
    assert rows["ps"][4] == "FAIL"
    notes = lines[lines.index("notes:") + 1 :]
    assert any(n.startswith("  collectives: ") and "broken on purpose" in n for n in notes), notes
    assert lines[-1].startswith("doctor: FAILED: collectives, ps (2 schemes, ")


@pytest.mark.slow
def test_doctor_quick_passes_on_this_machine_in_under_two_minutes():
    """The issue's "done when" on CPU: the real command, every scheme with its twin, in a fresh process (21-42 s on
    the 2-core machine, 66 s with its cores shared by other work: marked slow)."""
    began = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "parlab", "doctor", "--quick"], capture_output=True, text=True, timeout=600
    )
    seconds = time.perf_counter() - began
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["scheme", "backend", "world"])
    rows = [line.split() for line in lines[header + 1 : header + 1 + len(all_schemes())]]
    assert [r[0] for r in rows] == list(all_schemes())
    for r in rows:
        assert r[1:5] == ["gloo", "4", "cpu", "PASS"] and r[6] in ("PASS", "SKIPPED"), r
    assert lines[-1].startswith("doctor --quick: every scheme passed")
    assert seconds < 120, f"doctor --quick took {seconds:.0f} s"


@pytest.mark.slow
def test_the_gpu_check_writes_its_tables_timings_and_log_to_one_folder(tmp_path):
    """benchmarks/gpu_check.sh on this CPU machine (one scheme, to keep it short): every file it promises."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    folder = tmp_path / "check"
    out = subprocess.run(
        ["bash", str(script), str(folder), "--quick", "--only", "collectives"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["doctor.json", "doctor.txt", "log.txt", "startup.txt"]
    report = json.loads((folder / "doctor.json").read_text())
    assert report["passed"] and [r["scheme"] for r in report["schemes"]] == ["collectives"]
    text = (folder / "doctor.txt").read_text()
    assert "launch phases" in text and text.strip().splitlines()[-1].startswith("doctor --quick: every scheme passed")
    startup = (folder / "startup.txt").read_text().splitlines()
    assert startup[0].startswith("import torch:") and "(PASS)" in startup[2] and startup[4].startswith("goal: ")
    log = (folder / "log.txt").read_text()
    assert "--- versions" in log and "doctor: collectives ... PASS" in log  # the doctor's progress lands in the log


def test_a_launch_that_cannot_start_is_reported_and_fails_the_doctor(monkeypatch):
    """NCCL that cannot start, say: the timing says why, the doctor goes on to the schemes, and fails."""
    import parlab

    def refused(fn, world, backend=None, **kwargs):
        raise RuntimeError("NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)")

    monkeypatch.setattr(parlab, "launch", refused)
    timing = doctor.timed_launch("first on the GPU", 1, "nccl")
    assert (
        not timing.ok
        and timing.error == "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)"
    )
    lines = doctor.launch_lines([_timing("warm", "gloo", 0.04), timing])
    assert lines[-1] == f"  first on the GPU (nccl, world 1) FAILED: {timing.error}"

    monkeypatch.undo()  # the scheme runs for real; the launch timings are the failed one
    monkeypatch.setattr(doctor, "launch_timings", lambda gpus: [timing])
    out = run_cli("doctor", "--quick", "--only", "collectives")
    assert out.returncode == 1
    assert out.stdout.strip().splitlines()[-1].startswith("doctor --quick: FAILED: the first on the GPU launch (nccl)")


def test_the_one_gpu_plan_passes_on_gloo():
    """What the doctor runs on a one-GPU machine (world 1 wherever a scheme admits it, gloo's 4 ranks elsewhere),
    here on gloo: the world-1 paths (zero's wire check divided by zero there) are checked without a GPU."""
    rows = [
        doctor.run_scheme_row(name, scheme, gpus=1, quick=True, twin=True) for name, scheme in all_schemes().items()
    ]
    worlds = {r.scheme: r.world for r in rows}
    assert {name for name, world in worlds.items() if world == 4} == {"megatron-sp", "usp", "hybrid", "ps"}
    assert set(worlds.values()) == {1, 4}
    failed = [(r.scheme, r.notes) for r in rows if not doctor.row_passed(r)]
    assert not failed, failed
