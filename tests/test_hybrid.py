"""Hybrid parallelism on a device mesh (dp x pp x cp x tp, with ZeRO, SP, any schedule): one step equal to one
device in float64, every axis' bytes by kind of call equal to the theory, every invalid combination refused."""

from __future__ import annotations

import pytest
from cli_in_process import run_cli

from parlab.runs.hybrid import HybridOptions, run_hybrid
from parlab.runs.registry import run_scheme

# Each 4-rank combination exercises a different composition; together they cover every axis and option.
COMBINATIONS = [
    {"dp": 1, "pp": 1, "cp": 2, "tp": 2, "cp_method": "ulysses"},  # Ulysses over cp on TP's heads
    {"dp": 1, "pp": 2, "cp": 1, "tp": 2, "sequence_parallel": True, "schedule": "zb"},  # SP across stages, zb
    {"dp": 2, "pp": 2, "cp": 1, "tp": 1, "zero": 3},  # ZeRO-3 over dp under a pipeline's micro-batches
    {"dp": 2, "pp": 1, "cp": 2, "tp": 1, "zero": 2, "cp_method": "zigzag"},  # ZeRO-2 over dp x cp, zigzag ring
    {"dp": 1, "pp": 2, "cp": 2, "tp": 1, "schedule": "interleaved"},  # ring attention in interleaved stages
]


def _check(report: dict) -> None:
    assert report["passed"], report["verdicts"]
    assert report["max_abs_err"] <= 1e-10
    measured, theory = report["comm"]["per_axis_measured"], report["comm"]["per_axis_theory"]
    assert measured == theory and all(any(v) for v in theory.values())  # every axis kind used, as theory says
    assert report["bytes_per_rank"]["params"] == report["bytes_per_rank"]["params_theory"]


@pytest.mark.parametrize("options", COMBINATIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_each_composition_of_axes_matches_one_device_and_each_axis_its_theory(options):
    _, report = run_hybrid(**options, steps=1)
    _check(report)
    kinds = set(report["comm"]["per_axis_theory"])
    axes = {key.split()[0] for key in kinds}
    grad_axis = "dp_cp" if options["cp"] > 1 else "dp"  # the gradients' group: dp, or dp x cp flattened
    used = {a for a in ("pp", "cp", "tp") if options[a] > 1} | (
        {grad_axis} if options["dp"] * options["cp"] > 1 else set()
    )
    assert axes == used
    if options.get("zero"):  # ZeRO: reduce-scatter and all-gather over dp x cp, no all-reduce there
        assert {f"{grad_axis} reduce_scatter", f"{grad_axis} all_gather"} <= kinds
        assert f"{grad_axis} all_reduce" not in kinds
    if options["cp"] > 1:  # Ulysses all-to-alls, the ring sends
        assert ("cp all_to_all" in kinds) == (options.get("cp_method") == "ulysses")


def test_dp_x_cp_x_tp_on_8_ranks_and_the_mesh_layout():
    _, report = run_hybrid(dp=2, cp=2, tp=2, steps=1)
    _check(report)
    assert report["world_size"] == 8
    assert report["mesh"]["coords"][5] == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}  # tp fastest, then cp, pp, dp
    assert set(report["comm"]["per_axis_theory"]) == {"dp_cp all_reduce", "cp send", "tp all_reduce"}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"zero": 2, "optimizer": "sgd"}, "zero=2 steps with ZeRO's own Adam"),
        ({"dp": 1, "tp": 4, "zero": 1}, r"shards over the dp x cp ranks, and there is only one"),
        ({"dp": 2, "pp": 2, "tp": 1, "zero": 3, "schedule": "zb"}, "zero=3 with schedule 'zb'"),
        ({"dp": 2, "pp": 1, "tp": 1, "zero": 3, "tied": True}, "tied LM head"),
        ({"pp": 2, "tp": 1, "dp": 1, "sequence_parallel": True}, "sequence_parallel needs tp>=2"),
        ({"dp": 2, "pp": 2, "tp": 2, "world_size": 4}, "mesh dp=2 x pp=2 x cp=1 x tp=2 = 8 ranks, but world_size=4"),
        ({"dp": 1, "pp": 1, "tp": 3}, r"the tp axis \(tp=3\): heads=4 is not divisible by tp=3"),
        ({"dp": 1, "pp": 3, "tp": 1, "microbatches": 3, "batch": 6}, "layers=4 is not divisible by pp=3"),
        ({"dp": 3, "pp": 1, "tp": 1}, "batch=8 must split into dp=3 replicas"),
        ({"dp": 0, "pp": 1, "tp": 1, "world_size": 1}, "dp=0 must be >= 1"),
        ({"dp": 1, "cp": 3, "tp": 1}, r"the cp axis \(cp=3, ring\): seq=16 is not divisible by 3 chunks"),
        ({"dp": 1, "cp": 4, "tp": 1, "cp_method": "zigzag", "seq": 12}, "not divisible by 8 chunks"),
        ({"dp": 1, "cp": 2, "tp": 4, "cp_method": "ulysses"}, r"heads / tp = 1 is not divisible by cp=2"),
        ({"dp": 1, "cp": 4, "tp": 2, "sequence_parallel": True, "seq": 4}, "do not split into tp=2"),
        ({"dp": 1, "pp": 2, "tp": 1, "tied": True}, "tied embedding and LM head"),
        ({"dp": 1, "pp": 2, "tp": 1, "microbatches": 1}, "needs microbatches >= stages"),
    ],
)
def test_every_invalid_combination_is_refused_before_launch_with_its_reason(options, message, monkeypatch):
    monkeypatch.setattr("parlab.runs.registry.launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=message):
        run_scheme("hybrid", **options)


def test_zero_picks_adam_unless_told_otherwise():
    opts = HybridOptions.make(zero=3)
    assert (opts.optimizer, opts.lr) == ("adam", 0.01)
    assert (HybridOptions.make().optimizer, HybridOptions.make().lr) == ("sgd", 0.1)


def test_an_invalid_combination_on_the_command_line_is_one_error_line():
    done = run_cli("run", "hybrid", "--dp", "1", "--cp", "2", "--tp", "4", "--cp-method", "ulysses")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("parlab: error: the cp axis (Ulysses, --cp 2)")
