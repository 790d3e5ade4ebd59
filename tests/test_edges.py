"""Reliability at the edges: impossible values are refused in one line before any process starts."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from parlab.cli import main
from parlab.core.pace import parse as parse_pace
from parlab.runs import registry as runs
from parlab.runs.registry import all_schemes


@pytest.fixture
def no_launch(monkeypatch):
    """Any attempt to start ranks fails the test: refusals must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for options that should have been refused")

    monkeypatch.setattr(runs, "launch", refuse)  # what launch_scheme calls


def _float_options():
    cases = []
    for name, scheme in all_schemes().items():
        for f in dataclasses.fields(scheme.options):
            default = f.default if f.default is not dataclasses.MISSING else None
            if isinstance(default, float) and f.name not in dict(scheme.fixed):
                cases.append((name, f.name, f.metadata.get("flag") or "--" + f.name.replace("_", "-")))
    return cases


FLOATS = _float_options()


def test_there_are_float_options_to_check():
    assert {"lr", "slowdown", "loss_scale"} <= {option for _, option, _ in FLOATS}


@pytest.mark.parametrize("scheme, option, flag", FLOATS, ids=[f"{s}-{o}" for s, o, _ in FLOATS])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "-1"])
def test_every_float_option_of_every_scheme_is_finite_and_in_range(scheme, option, flag, value, capsys, no_launch):
    extra = ["--straggler", "1"] if scheme == "ps" else []
    assert main(["run", scheme, *extra, f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parlab: error: ") and flag in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "pace, message",
    [
        ("unit=1e999s", "unit=inf must be between"),
        ("unit=nan", "got 'unit=nan'"),
        ("bandwidth=1e-9MB/s", "bandwidth=0.001 must be between 1KB/s"),
        ("alpha=100s", "alpha=100 must be between"),
        ("unit=20ms,unit=30ms", "unit is given twice"),
        ("unit=1.2.3ms", "is not a number"),
    ],
)
def test_a_pace_that_no_lesson_could_wait_for_is_refused(pace, message, capsys, no_launch):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_pace(pace)
    assert main(["run", "dp", "--pace", pace]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("memory", ["nan", "inf", "0", "-5"])
def test_plan_refuses_a_memory_that_is_not_a_positive_finite_number(memory, capsys):
    assert main(["plan", f"--memory={memory}"]) == 2
    assert "--memory" in capsys.readouterr().err


def test_hybrid_names_the_tp_axis_not_the_world(capsys, no_launch):
    assert main(["run", "hybrid", "--dp", "2", "--pp", "2", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "the tp axis (--tp 3): --heads 4 is not divisible by --tp 3" in err and "world_size" not in err, err


def _closed_reader(*args: str) -> tuple[int, str]:
    """Run the CLI with its stdout read by nobody (a `| head` that already left)."""
    process = subprocess.Popen([sys.executable, "-m", "parlab", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    err = process.stderr.read().decode()
    return process.wait(timeout=120), err


def test_a_reader_that_leaves_early_gets_no_traceback():
    code, err = _closed_reader("plan", "--top", "50")
    assert code == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_ctrl_c_stops_a_run_quietly_with_status_130():
    process = subprocess.Popen(
        [sys.executable, "-m", "parlab", "run", "pp", "--steps", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:  # wait for the launch's first progress line (a loaded machine is slow)
        line = process.stderr.readline()
        seen.append(line)
        if not line or "ranks started" in line:
            break
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    err = "".join(seen) + err
    assert process.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "parlab: interrupted"


def _rank_number() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@pytest.mark.parametrize("threads", [-1, 0, 1.5, True, "2"])
def test_launch_refuses_bad_threads_before_anything_starts(threads):
    import parlab

    with pytest.raises(ValueError, match="threads must be"):
        parlab.launch(_rank_number, 2, threads=threads, echo=False)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -1])
def test_launch_refuses_a_timeout_that_is_not_a_finite_positive_number(timeout):
    import parlab

    with pytest.raises(ValueError, match="timeout must be"):
        parlab.launch(_rank_number, 2, timeout=timeout, echo=False)


def test_a_rank_whose_set_up_fails_reports_it_and_never_runs_the_servers_code(monkeypatch):
    import importlib

    import parlab

    launch_module = importlib.import_module("parlab.runtime.launcher")
    # Let a bad value through the parent's checks, as a future bug might: the ranks fail while they set up.
    monkeypatch.setattr(launch_module, "check_launch_args", lambda *args: "gloo")
    with pytest.raises(parlab.RankError) as failed:
        parlab.launch(_rank_number, 2, threads=-1, echo=False, timeout=30)
    assert "set_num_threads" in failed.value.remote_traceback and "BufferError" not in str(failed.value)
    monkeypatch.undo()
    assert list(parlab.launch(_rank_number, 2, echo=False)) == [0, 1]  # the server is fine


@pytest.mark.parametrize(
    "argv",
    [
        ["--devices", "65536"],
        ["--devices", "16384"],
        ["--layers", "1000000", "--hidden", "1000000", "--heads", "1000", "--devices", "1000000"],
        ["--devices", "720720", "--batch", "720720", "--layers", "120", "--heads", "120", "--hidden", "1200"],
    ],
)
def test_the_planner_answers_any_size_within_seconds(argv, capsys):
    started = time.perf_counter()
    code = main(["plan", *argv])
    seconds = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert seconds < 5, seconds
    assert (code == 0 and "plans fit" in out) or (code == 2 and err.startswith("parlab: error: ")), (code, err)


def test_the_planner_still_finds_every_plan_a_brute_force_search_finds():
    from parlab.schemes.hybrid.planner import Cluster, ModelSpec, plans

    model, cluster = ModelSpec(12, 768, 12, 1024, 50257, tied=True), Cluster(48, 80e9, 8)
    found = {(e.plan.dp, e.plan.tp, e.plan.pp) for e in plans(model, cluster, 96)}
    brute = {
        (48 // (tp * pp), tp, pp)
        for tp in range(1, 49)
        for pp in range(1, 49)
        if 48 % (tp * pp) == 0 and 12 % tp == 0 and 12 % pp == 0 and tp <= 8
        and 96 % (48 // (tp * pp)) == 0 and 96 // (48 // (tp * pp)) >= pp
    }  # fmt: skip
    assert found == brute and len(found) > 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices-per-node", "0"], "--devices-per-node 0: must be positive"),
        (["--hidden", "100", "--heads", "7"], "--hidden 100 is not divisible by --heads 7"),
    ],
)
def test_the_planner_names_the_flag_at_fault(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"parlab: error: {message}"


@pytest.mark.parametrize(
    "folder, message",
    [
        ("/proc/1/nope", "cannot be created or written here"),
        ("/etc/passwd/sub", "'/etc/passwd' is a file"),
        ("/etc/passwd", "is a file, not a folder"),
    ],
)
def test_a_disk_folder_that_cannot_be_made_is_refused_before_launch(folder, message, capsys, no_launch):
    assert main(["run", "offload", "--target", "disk", "--folder", folder]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parlab: error: ") and message in err and len(err.splitlines()) == 1, err


def test_checking_a_new_folder_leaves_nothing_behind(tmp_path):
    from parlab.core.scratch import check_folder

    check_folder(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []


def test_offload_folders_of_dead_or_zombie_owners_are_swept_by_any_run(tmp_path, monkeypatch):
    import tempfile

    from parlab.core.scratch import FOLDER_PREFIX
    from parlab.runs.registry import all_schemes

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()  # gone and reaped
    zombie = subprocess.Popen(["true"])  # not reaped yet: a zombie, as under a pid 1 that does not reap
    time.sleep(0.5)
    live = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-live"
    folders = [tmp_path / f"{FOLDER_PREFIX}{pid}-abcd1234" for pid in (dead.pid, zombie.pid)] + [live]
    for folder in folders:
        (folder / "rank0").mkdir(parents=True)
        (folder / "rank0" / "m.bin").write_bytes(b"x" * 10)
    try:
        all_schemes()["offload"].make_options(target="disk")  # what the CLI does before it launches
        assert [f.exists() for f in folders] == [False, False, True]
    finally:
        zombie.wait()


def _sizes_disagree(traced: bool):
    import torch
    import torch.distributed as dist

    from parlab.core import comm

    x = torch.ones(4 if dist.get_rank() == 0 else 8)
    (comm.all_reduce if traced else dist.all_reduce)(x)
    return x


@pytest.mark.parametrize("traced", [False, True], ids=["dist", "comm"])
def test_a_size_mismatch_that_gloo_aborts_on_is_named_in_the_exception(traced):
    import parlab

    with pytest.raises(parlab.RankError) as failed:
        parlab.launch(_sizes_disagree, 2, traced, echo=False, timeout=60)
    text = str(failed.value)
    assert "Collective mismatch: gloo on rank" in text and "Received data size doesn't match" in text, text
    assert "exited with code -6" in text or "Traceback" in text  # the rank that died, or the one left alone
    assert list(parlab.launch(_rank_number, 2, echo=False)) == [0, 1]


def _send_past_the_last_rank():
    import torch
    import torch.distributed as dist

    from parlab.core import comm

    if dist.get_rank() == 0:
        comm.wait_all([comm.isend(torch.ones(3), dist.get_world_size())])  # rank 2 of a world of 2: no such rank
    return dist.get_rank()


def test_a_send_to_a_rank_that_does_not_exist_is_diagnosed_not_a_crash_of_the_watch():
    import parlab

    started = time.monotonic()
    # gloo either waits (then the watch names the call) or crashes the rank (segfault): never the watch itself.
    with pytest.raises((parlab.CollectiveMismatch, parlab.RankError)) as failed:
        parlab.launch(_send_past_the_last_rank, 2, echo=False, timeout=60)
    text = str(failed.value)
    assert "12 bytes to rank 2" in text or "rank 0 failed" in text, text
    assert time.monotonic() - started < 30  # diagnosed, not the timeout
    assert list(parlab.launch(_rank_number, 2, echo=False)) == [0, 1]


def _start_escapees() -> list[int]:
    """Rank code that starts processes in sessions of their own (out of reach of its process group), two deep."""
    started = subprocess.Popen(["setsid", "sleep", "302"])
    shell = subprocess.Popen(["setsid", "sh", "-c", "setsid sleep 303 & sleep 304"])
    time.sleep(0.5)
    return [started.pid, shell.pid]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_processes_the_rank_code_started_in_new_sessions_stop_with_the_launch():
    import parlab

    pids = [pid for rank_pids in parlab.launch(_start_escapees, 2, echo=False) for pid in rank_pids]
    sleepers = [int(e) for e in os.listdir("/proc") if e.isdigit() and _cmdline(int(e)) in ("sleep 303",)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(pid) for pid in pids + sleepers):
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]
    left = [int(e) for e in os.listdir("/proc") if e.isdigit() and _cmdline(int(e)) in ("sleep 302", "sleep 303")]
    assert not [pid for pid in left if not _gone(pid)], left


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _both_send_first():
    import torch
    import torch.distributed as dist

    from parlab.core import comm

    peer = 1 - dist.get_rank()
    big = torch.ones(1 << 20)  # large enough that a blocking send waits for its receiver
    comm.send(big, peer)
    comm.recv(torch.empty_like(big), peer)
    return True


def test_a_cycle_of_blocking_sends_is_called_a_deadlock():
    import parlab

    with pytest.raises(parlab.CollectiveMismatch, match="deadlock: each of these ranks waits in a blocking send"):
        parlab.launch(_both_send_first, 2, echo=False, timeout=60)


def test_a_rank_that_dies_without_a_word_is_named_not_the_peer_its_death_broke():
    """Rank 2 leaves with os._exit while the others wait for it in an all-reduce: gloo raises in a peer
    ("Connection reset by peer") perhaps before the server sees rank 2's process end; the launch names rank 2."""
    import torch
    import torch.distributed as dist

    import parlab

    def fn():
        if dist.get_rank() == 2:
            time.sleep(0.2)
            os._exit(3)
        dist.all_reduce(torch.ones(4))

    for _ in range(3):  # the race went the wrong way in about one launch of three
        with pytest.raises(parlab.RankError) as caught:
            parlab.launch(fn, 4, timeout=60, echo=False)
        assert caught.value.rank == 2, str(caught.value)
