"""Valid runs that failed (issue 41, items 7-11): each must run and pass, with its twin where it has one."""

from __future__ import annotations

import json

import pytest
from cli_in_process import run_cli

from parlab.runs.registry import get_scheme


def _passed(*argv: str) -> dict:
    """`python -m parlab run ARGV --json`: exit status 0, no traceback, the report's passed true; the report."""
    out = run_cli("run", *argv, "--json")
    assert out.returncode == 0 and "Traceback" not in out.stderr, (out.stderr[-3000:], out.stdout[-3000:])
    report = json.loads(out.stdout)
    assert report["passed"], report["verdicts"]
    return report


def test_the_hybrid_twin_is_skipped_with_its_reason_when_cp_splits_the_sequence():
    """Item 7: the twin composed fully_shard on a (dp, tp) mesh that left the cp ranks out: a traceback (dp 1)
    or a false "torch refused" (dp 2)."""
    report = _passed("hybrid", "--dp", "1", "--tp", "1", "--cp", "4", "--cp-method", "usp", "--ulysses", "2")
    assert "with cp > 1 it would also need torch's context_parallel" in report["twin"]["skipped"], report["twin"]


@pytest.mark.parametrize("ulysses, ring", [(4, 1), (1, 4), (1, 1)])
def test_usp_with_an_axis_of_size_one_counts_its_bytes_on_that_axis(ulysses, ring):
    """Item 8: an axis as large as the world was torch's default group, filed under no axis: "measured 0"."""
    report = _passed("usp", "--ulysses", str(ulysses), "--ring", str(ring), "--world", str(ulysses * ring))
    comm = report["comm"]
    assert comm["ulysses_per_step"][0] == comm["ulysses_per_step_theory"] > 0
    assert comm["ring_per_step"][0] == comm["ring_per_step_theory"]


def test_moe_with_full_recomputation_counts_the_recomputed_all_to_alls():
    """Item 9: the block's forward runs again in the backward, with its counts, dispatch and combine."""
    report = _passed("moe", "--world", "4", "--recompute", "full", "--steps", "1", "--no-twin")
    assert report["all_to_all_bytes"] == report["all_to_all_theory"]
    none = _passed("moe", "--world", "4", "--steps", "1", "--no-twin")
    assert all(r > n for r, n in zip(report["all_to_all_bytes"], none["all_to_all_bytes"], strict=True))


@pytest.mark.parametrize("stage", ["2", "3"])
def test_zero_mixed_precision_is_compared_with_fsdp2_as_the_scheme_compares_it(stage):
    """Item 10: the twin held bf16 to float32's 1e-5, and its failure exited 1 under a JSON "passed": true."""
    report = _passed("zero", "--stage", stage, "--world", "4", "--mixed-precision", "--steps", "1")
    twin = report["twin"]
    assert twin["passed"] and twin["tol"] == 1e-4 and "99% of the elements" in twin["verdicts"][1], twin


def test_a_failed_twin_fails_the_json_as_it_fails_the_exit_status(monkeypatch):
    from parlab.twins import registry as twins

    def failing(*args, **kwargs):
        return {"name": "a twin", "max_abs_err": 1.0, "tol": 0.0, "passed": False, "verdicts": [], "comm": None}

    monkeypatch.setattr(twins, "twin_report", failing)
    out = run_cli("run", "collectives", "--world", "2", "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["passed"] is False and report["scheme_passed"] is True


def test_the_readmes_async_server_with_a_dead_worker_runs_as_written():
    """Item 11: `run ps --mode async --kill-rank 2` was refused for want of --at-step; it dies in step 3 of 6."""
    report = _passed("ps", "--mode", "async", "--kill-rank", "2", "--no-dp")
    assert report["killed_rank"] == 2 and list(report["dead"]) == ["2"]  # (JSON keys are strings)
    assert report["dead"]["2"]["after_pushes"] == 2 and len(report["updates"]) == 3 * 6 - 4  # silent from step 3


@pytest.mark.parametrize("scheme, profile", [("dp", "h100"), ("pp", "h100"), ("hybrid", "h100"), ("zero", "a100")])
def test_a_hardware_pace_takes_the_default_sizes(scheme, profile):
    """Item 11: a toy model's forward is nanoseconds on a GPU against a message's microseconds; at F = 50 ms a
    message took a minute, and the run was refused. The latency now lasts 50 ms, F its share of it."""
    opts = get_scheme(scheme).make_options(pace=profile)
    pace = opts.pace_model()
    assert pace.alpha == pytest.approx(0.05) and 1e-6 <= pace.unit < pace.alpha and pace.latency_bound


def test_a_paced_h100_run_at_the_default_sizes_runs_and_says_why_its_spans_overran():
    report = _passed("dp", "--pace", "h100", "--steps", "1", "--no-twin")
    assert report["paced"] and "H100 times" in report["paced"]
    note = report["verdicts"][-1]
    assert note.startswith("paced run (") and (
        "shorter than a message's latency" in note or not report["paced_overruns"]
    )
