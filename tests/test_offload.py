"""Offload (parlab.schemes.zero.offload): Adam's state on the host (cpu) or in memory-mapped files (disk) trains exactly
like the same run without offload and like one device; each place holds what the formulas say; the copies move what
theory says and overlap backward / the optimizer step; the disk folder is removed after success, a rank's failure,
a timeout that kills the ranks, and a Ctrl-C; a budget too small is refused before launch, naming the amounts."""

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import temp_folder_of_our_own

from parlab import launch
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches, train_single_device
from parlab.core.scratch import FOLDER_PREFIX, offload_folder, sweep_orphans
from parlab.lessons import offload as lesson
from parlab.runs.offload import parse_bytes, run_offload
from parlab.runs.registry import get_scheme
from parlab.runtime.errors import LaunchTimeout, RankError
from parlab.schemes.zero.offload import TARGETS, train_offload
from parlab.schemes.zero.stages import plan_units
from parlab.schemes.zero.theory import offload_memory
from parlab.views import plots

TINY = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)  # 7,744 parameters, 6 units
LR = 1e-3


@pytest.fixture(scope="module", autouse=True)
def private_tmp(tmp_path_factory):
    """A temp folder of this module's own, for this process, its rank server (and so its ranks) and the command
    lines it starts: the folders these tests count are theirs alone. (Other test files run offload at the same time
    in other pytest-xdist workers; their folders under the shared temp dir came and went in this module's counts.)"""
    with temp_folder_of_our_own(str(tmp_path_factory.mktemp("offload-tmp"))) as folder:
        yield folder


def _folders() -> set[Path]:
    """The offload folders under the temp dir now (this module's own: private_tmp)."""
    return set(Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*"))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def _three_targets(folder: str):
    """Rank code: the same training with the state on the device, the host and the disk."""
    batches = make_batches(TINY, 8, 3, 0)
    return {t: train_offload(build_model(TINY, 0), batches, target=t, lr=LR, folder=folder) for t in TARGETS}


@pytest.fixture(scope="module")
def three_targets():
    before = _folders()
    with offload_folder() as folder:
        results = launch(_three_targets, 2, str(folder), echo=False)
    assert _folders() == before  # nothing left behind
    return results


# --------------------------------------------------------------------------------------------- the numerics


def test_cpu_and_disk_equal_the_run_without_offload_and_one_device(three_targets):
    single = train_single_device(TINY, make_batches(TINY, 8, 3, 0), 0, "adam", LR)
    for rank in three_targets:
        none = rank["none"]["params"]
        assert _max_diff(none, single.params) <= 1e-10  # ZeRO-2 with Adam written out = torch.optim.Adam
        for target in ("cpu", "disk"):
            assert _max_diff(rank[target]["params"], none) == 0.0  # the same arithmetic, elsewhere
            assert rank[target]["losses"] == rank["none"]["losses"]
    moved = _max_diff(three_targets[0]["cpu"]["params"], {n: p for n, p in build_model(TINY, 0).named_parameters()})
    assert moved > 1e-4  # it trained


# ---------------------------------------------------------------------------------------- bytes by place


@pytest.mark.parametrize("target", TARGETS)
def test_bytes_by_place_equal_the_formulas(three_targets, target):
    N, b = 2, TINY.dtype_bytes
    numels = [u.numel for u in plan_units(build_model(TINY), N)]
    theory = offload_memory(numels, N, target, b, b)
    for rank in three_targets:
        measured = rank[target]
        for place in ("device", "host", "disk"):
            steady = {k: v for k, v in measured["steady"][place].items() if v}
            assert steady == {k: v for k, v in theory["steady"][place].items() if v}, (target, place)
        assert measured["peak"]["device"] == theory["peak"]["device"]  # the bucket bound is reached exactly
        assert sum(measured["peak"]["host"].values()) <= theory["peak_total"]["host"]
    if target != "none":  # what offload is for: the device holds the parameters only
        assert theory["steady"]["device"] == {"params": b * N * theory["S"]}
    if target == "disk":  # ... and the host no optimizer state: it is in the files, read ahead unit by unit
        assert "optimizer" not in theory["steady"]["host"]
        assert three_targets[0]["disk"]["peak"]["host"]["read-ahead"] > 0


def test_the_formula_at_paper_scale():
    """ZeRO-Offload, fp16 compute and fp32 master on one GPU (N = 1): the device keeps 2 Psi, the host 16 Psi
    (4 Psi fp32 gradients + 12 Psi master, m, v); a 10B model's optimizer state needs 120 GB of host memory."""
    psi = 10_000_000_000
    cpu = offload_memory([psi], 1, "cpu", b_c=2, b_m=4)
    assert cpu["steady_total"] == {"device": 2 * psi, "host": 16 * psi, "disk": 0}
    assert cpu["steady"]["host"]["optimizer"] == 120e9
    disk = offload_memory([psi // 4] * 4, 4, "disk", b_c=2, b_m=4)
    assert disk["steady_total"]["disk"] == 12 * psi / 4 and disk["steady_total"]["host"] == 4 * psi / 4


# ------------------------------------------------------------------------------------- copies and overlap


def test_copies_move_what_theory_says_and_overlap(three_targets):
    results = three_targets
    trace = results.trace
    rank0 = trace.select(rank=0)
    offloads = [e for e in rank0 if e.kind == "offload"]
    reads = [e for e in rank0 if e.kind == "disk_read"]
    S = plan_units(build_model(TINY), 2)
    S = sum(u.shard_numel for u in S)
    b = TINY.dtype_bytes
    # The cpu and disk runs each copy every gradient shard to the host once per step, and every parameter shard
    # back; the disk run reads and writes master, m and v once per step.
    assert sum(e.bytes for e in offloads) == 2 * 3 * b * S
    assert sum(e.bytes for e in rank0 if e.kind == "upload") == 2 * 3 * b * S
    assert sum(e.bytes for e in reads) == 3 * 3 * b * S
    assert sum(e.bytes for e in rank0 if e.kind == "disk_write") == 3 * 3 * b * S
    # Overlap: gradient copies start while backward still runs.
    during, n_offloads = lesson.overlaps(trace, rank=0)["gradient copies started during backward"]
    assert n_offloads == len(offloads) and during > 0


def test_reads_ahead_overlap_adam_on_a_paced_run():
    """With an emulated link (a read of n bytes takes 10 ms + n / 50 MB/s), the state of unit k+1 is being read
    while unit k is stepped; the gradient copies run while backward goes on.

    (10 ms, not the default 1 ms: on a busy machine the main thread can wake more than 1 ms after unit k's read
    ended, when unit k+1's had ended too: 5 of 12 reads seen in flight with three test workers on two cores; with
    10 ms, 10 of 12 in each of 5 runs beside three busy loops.)"""
    results, report = run_offload(2, "disk", steps=2, reference=False, pace="alpha=10ms")
    assert report["passed"]
    counts = lesson.overlaps(results.trace, rank=0)
    ahead, n_reads = counts["state reads in flight during the previous unit's Adam"]
    during, n_offloads = counts["gradient copies started during backward"]
    assert n_reads == 12 and ahead >= 8  # 5 of the 6 units per step can be read ahead
    assert n_offloads == 12 and during >= 6


# ------------------------------------------------------------------------------- the folder, always removed


def _fail_at_step_1(folder, hang: bool):
    """Rank code: rank 1 raises (or every rank hangs) in the forward of step 1, with the disk files open."""
    calls = []

    def loss_fn(model, x, y):
        calls.append(1)
        if len(calls) == 2:
            if hang:
                time.sleep(120)
            elif dist.get_rank() == 1:
                raise RuntimeError("a rank fails mid-run")
        return lm_loss(model(x), y)

    batches = make_batches(TINY, 8, 3, 0)
    return train_offload(build_model(TINY), batches, target="disk", lr=LR, folder=folder, loss_fn=loss_fn)


def test_no_folder_left_after_a_rank_fails():
    before = _folders()
    with pytest.raises(RankError, match="a rank fails mid-run"):
        with offload_folder() as folder:
            launch(_fail_at_step_1, 2, str(folder), False, echo=False)
    assert not folder.exists() and _folders() == before


def test_no_folder_left_after_a_timeout_kills_the_ranks():
    before = _folders()
    with pytest.raises(LaunchTimeout):
        with offload_folder() as folder:
            launch(_fail_at_step_1, 2, str(folder), True, echo=False, timeout=4)
    assert not folder.exists() and _folders() == before


def test_rank_owned_folders_of_killed_ranks_are_swept():
    """Without a parent folder each rank makes its own; a SIGKILLed rank cannot remove it, so the next
    offload_folder() (or sweep_orphans()) removes every folder whose owner process is gone."""
    before = _folders()
    with pytest.raises(LaunchTimeout):
        launch(_fail_at_step_1, 2, None, True, echo=False, timeout=4)
    time.sleep(0.5)  # the killed ranks are reaped
    sweep_orphans()
    assert _folders() == before


def test_cli_run_interrupted_by_ctrl_c_leaves_no_folder():
    """`python -m parlab run offload --target disk`, Ctrl-C once the ranks' files exist: the ranks are killed, the
    parent exits, and the folder it named is gone."""
    before = _folders()
    cmd = [sys.executable, "-m", "parlab", "run", "offload", "--target", "disk", "--world", "2", "--steps", "200"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while not any((f / "rank0" / "m.bin").exists() for f in _folders() - before) and time.time() < deadline:
            time.sleep(0.1)
        assert _folders() - before, "the run never wrote its files"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
    assert _folders() == before


def test_no_folder_left_after_ctrl_c():
    with pytest.raises(KeyboardInterrupt):
        with offload_folder() as folder:
            (folder / "master.bin").write_bytes(b"x" * 100)
            raise KeyboardInterrupt
    assert not folder.exists()


# -------------------------------------------------------------------------------------------- the run module


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_run_reports_pass_at_world_4_and_removes_the_folder(target):
    before = _folders()
    results, report = run_offload(4, target, steps=2)
    assert report["passed"], report["verdicts"]
    assert report["max_abs_err"] <= 1e-10 and report["disk_folder_removed"] is True
    assert _folders() == before
    assert set(report["bytes_per_rank"]["steady"]) == {"device", "host", "disk"}
    assert report["bytes_per_rank"]["steady"]["disk"][0] == (180480 if target == "disk" else 0)
    assert {e.kind for e in results.trace.events} >= {"offload", "upload", "optimizer"}


def test_a_budget_too_small_is_refused_before_launch_naming_the_amounts():
    scheme = get_scheme("offload")
    need = scheme.make_options(world_size=2, target="cpu").memory()["peak_total"]
    with pytest.raises(ValueError, match=rf"device: needs {need['device']:,} bytes per rank, budget 1,000"):
        scheme.make_options(world_size=2, target="cpu", device_budget=1000)
    with pytest.raises(ValueError, match=r"host: needs [\d,]+ bytes per rank, budget 2,000"):
        scheme.make_options(world_size=2, target="disk", host_budget="2KB")
    scheme.make_options(world_size=2, target="cpu", device_budget=need["device"])  # exactly enough: accepted
    before = _folders()
    with pytest.raises(ValueError, match="too small"):
        run_offload(2, "disk", device_budget="1KB")
    assert _folders() == before


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="target='gpu' must be one of"):
        get_scheme("offload").make_options(target="gpu")
    with pytest.raises(ValueError, match="not a byte count"):
        parse_bytes("lots")
    assert parse_bytes("1.5MB") == 1_500_000 and parse_bytes("2KiB") == 2048 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="target='gpu'"):
        train_offload(build_model(TINY), [], target="gpu")


# ------------------------------------------------------------------------------------------ lesson 06 figures


def test_lesson_figures_show_the_measured_bytes_and_copies(three_targets):
    ledgers = {t: three_targets[0][t]["ledger"] for t in TARGETS}
    table = lesson.step_memory(ledgers["disk"], step=1)
    assert list(table) == list(lesson.MOMENTS)
    steady = three_targets[0]["disk"]["steady"]
    assert table["before the optimizer step"] == {p: {k: v for k, v in steady[p].items() if v} for p in steady}
    assert "read-ahead" in table["during the optimizer step"]["host"]
    assert "grad buckets" in table["during backward"]["device"]
    fig = lesson.draw_memory_by_place(ledgers, step=1)
    bars = [b for b in fig.data if b.xaxis == "x3"]  # the disk target's panel
    device = next(b for b in bars if b.name == "device")
    assert device.y[2] * 1e3 == sum(table["before the optimizer step"]["device"].values())
    step = lesson.draw_step(three_targets.trace, 1, "one step")
    names = {b.name: b.marker.color for b in step.data}
    assert names["offload"] == plots.kind_color("offload") and "disk read" in names
    seconds = lesson.copy_seconds(three_targets.trace)
    assert set(seconds) >= {"offload", "upload", "disk_read", "disk_write", "optimizer"}
    budget = lesson.draw_budget(10e9, 1, 2, 4, 32)
    assert [round(v) for v in budget.data[0].y] == [180, 20, 20]  # device GB: none, cpu, disk


def _mixed_precision():
    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float32")
    batches = make_batches(cfg, 8, 2, 0)
    return {t: train_offload(build_model(cfg, 0), batches, target=t, lr=LR, compute_dtype=torch.bfloat16)
            for t in ("none", "cpu")}  # fmt: skip


def test_mixed_precision_keeps_2_psi_on_the_device_and_16_psi_on_the_host():
    """bf16 compute copy, fp32 master weights, m and v (ZeRO-Offload's recipe): the same parameters as without
    offload; per rank the device holds 2 N S bytes of parameters, the host 4 S of gradients and 12 S of state."""
    results = launch(_mixed_precision, 2, echo=False)
    S = sum(u.shard_numel for u in plan_units(build_model(TINY), 2))
    for rank in results:
        assert _max_diff(rank["cpu"]["params"], rank["none"]["params"]) == 0.0
        assert rank["cpu"]["steady"]["device"]["params"] == 2 * 2 * S
        assert rank["cpu"]["steady"]["host"]["grads"] == 4 * S and rank["cpu"]["steady"]["host"]["optimizer"] == 12 * S


def test_a_folder_with_files_in_it_is_refused_and_kept(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty"):
        get_scheme("offload").make_options(target="disk", folder=str(tmp_path))
    with pytest.raises(ValueError, match="exists and is not empty"):
        run_offload(2, "disk", folder=str(tmp_path))
    with pytest.raises(ValueError, match="exists and is not empty"):
        with offload_folder(tmp_path):
            pass
    assert (tmp_path / "notes.txt").read_text() == "mine"
