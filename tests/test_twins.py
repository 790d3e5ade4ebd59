"""Every scheme beside its PyTorch twin (parlab/twins): same model, data and weights; float64.

Where both sides are exact (DDP, FSDP2, DTensor, pipelining) they must agree to 1e-10; a twin torch cannot run
here must say why. Small models and one or two steps keep each launch short."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
import torch

from parlab.runs.registry import all_schemes, get_scheme, launch_scheme
from parlab.twins import registry as twins
from parlab.twins.record import op_kind

EXACT = 1e-10


def twin_of(name: str, **options) -> tuple[dict, dict]:
    results, report = launch_scheme(name, twin=True, **options)
    assert report["passed"], report["verdicts"]  # parlab's own checks still pass with the twin run after it
    return report["twin"], report


def assert_exact(twin: dict) -> None:
    assert "skipped" not in twin, twin
    assert twin["passed"], twin["verdicts"]
    assert twin["tol"] <= EXACT and twin["max_abs_err"] <= EXACT
    assert twin["verdicts"] and all(line.endswith("PASS") for line in twin["verdicts"])


def test_all_reduce_twin_and_its_bytes():
    twin, report = twin_of("collectives", world_size=2, numel=256)
    assert_exact(twin)
    assert twin["comm"] == {"all_reduce": [256 * 8] * 2}  # one all_reduce of the whole tensor per rank


def test_ddp_twin_counts_the_gradient_bytes():
    """DDP run by the twin (not by parlab's rank code): its bucket all-reduces carry every gradient once a step."""
    twin, report = twin_of("dp", world_size=2, steps=2, batch=4, ddp=False)
    assert_exact(twin)
    assert twin["name"] == "torch DDP"
    assert twin["comm"]["all_reduce"] == [2 * report["grad_bytes"]] * 2  # = parlab's own payload per step
    assert report["comm"]["all_reduce"] == twin["comm"]["all_reduce"]


def test_ddp_twin_reuses_the_run_parlab_already_made():
    twin, _ = twin_of("dp", world_size=2, steps=1, batch=4)
    assert_exact(twin)
    assert twin["comm"] is None  # DDP ran inside parlab's rank code, untraced


def test_fsdp2_twin_of_zero3_moves_what_zero3_moves():
    twin, report = twin_of("zero", world_size=2, stage=3, steps=1, layers=1, reference=False)
    assert_exact(twin)
    assert twin["name"] == "torch FSDP2 fully_shard (ZeRO-3)"
    assert set(twin["comm"]) == {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("name", ["tp", "megatron-sp"])
def test_dtensor_twins_of_tensor_and_sequence_parallelism(name):
    options = {"method": name} if name == "megatron-sp" else {}
    twin, _ = twin_of(name, world_size=2, layers=1, steps=1, **options)
    assert_exact(twin)
    assert "parallelize_module" in twin["name"]
    if name == "megatron-sp":  # Partial -> Shard(1) is a reduce-scatter, Shard(1) -> Replicate an all-gather
        assert twin["comm"]["reduce_scatter"][0] > 0 and twin["comm"]["all_gather"][0] > 0
    else:
        assert set(twin["comm"]) == {"all_reduce"}  # Partial -> Replicate: the all-reduces parlab calls f and g


def test_hybrid_twin_fully_shard_times_parallelize_module():
    twin, _ = twin_of("hybrid", dp=2, tp=2, pp=1, layers=1, steps=1)
    assert_exact(twin)
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(twin["comm"])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipelining_twin_runs_the_same_stages(schedule):
    twin, _ = twin_of("pp", world_size=2, schedule=schedule, layers=4, microbatches=4, batch=8, steps=1)
    assert_exact(twin)
    assert twin["max_abs_err"] == 0.0  # the same operations in the same order: bit for bit
    assert twin["comm"]["send"][0] > 0 and twin["comm"]["recv"][0] > 0


def test_context_parallel_twin_is_skipped_with_torchs_own_error():
    twin, _ = twin_of("ring", world_size=2, layers=1, steps=1)
    assert twin["name"] == "torch context_parallel (SDPA)"
    assert "NotImplementedError" in twin["skipped"] and "sharding strategy" in twin["skipped"]
    assert "passed" not in twin


@pytest.mark.parametrize(
    ("scheme", "options", "why"),
    [
        ("ps", {}, "no parameter server"),
        ("pp", {"schedule": "zb"}, "two or more stages per rank"),
        ("offload", {"target": "disk"}, "no disk"),
        ("hybrid", {"pp": 2, "dp": 1, "tp": 2}, "pipelining"),
        ("dp", {"kill_rank": 1, "at_step": 2, "steps": 3}, "torch.distributed.checkpoint"),
    ],
)
def test_a_twin_that_cannot_run_says_why(scheme, options, why):
    """Decided from the options alone: nothing is launched."""
    opts = get_scheme(scheme).make_options(world_size=4, **options)
    twin = twins.twin_report(scheme, opts, results=None, outs=[None] * 4)
    assert why in twin["skipped"] and twin["name"]


@pytest.mark.parametrize(
    ("error", "parlabs"),
    [
        (RuntimeError("No backend type associated with device type cpu"), True),  # the first GPU run's tp twin
        (RuntimeError("target is on cpu, different from other tensors on cuda:0 (when checking argument)"), True),
        (RuntimeError("Expected all tensors to be on the same device, but found at least two devices"), True),
        (
            NotImplementedError("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a"),
            False,
        ),
        (RuntimeError("Cannot access accelerator device when none is available."), False),
    ],
)
def test_a_twin_on_the_wrong_device_fails_where_torchs_refusal_is_skipped(monkeypatch, error, parlabs):
    """A tensor on the wrong device is parlab's bug: the twin FAILS (the first GPU run called two of them "torch
    refused on this machine"); torch refusing an operation is a skip, quoted."""

    def rank(opts, value):
        raise error

    monkeypatch.setattr(twins, "registry", lambda: {"tp": twins.Twin("a twin", rank, None)})
    opts = get_scheme("tp").make_options(world_size=2)
    outs = [twins.run_twin("tp", opts, value={})] * 2  # what each rank sent back
    twin = twins.twin_report("tp", opts, results=None, outs=outs)
    line = twins.twin_line({"scheme": "tp", "twin": twin})
    if parlabs:
        assert twin["passed"] is False and twin["error"].startswith("a tensor on the wrong device: RuntimeError: ")
        assert line.startswith("tp vs a twin: FAIL: a tensor on the wrong device")
    else:
        assert "passed" not in twin and twin["skipped"].startswith("torch refused on this machine: ")
        assert line.startswith("tp vs a twin: SKIPPED: torch refused")


def test_every_listed_scheme_has_a_twin_or_a_reason():
    assert set(all_schemes()) <= set(twins.registry())


def test_the_recorder_names_collectives_as_parlab_does():
    assert op_kind(torch.ops.c10d.allreduce_.default) == ("all_reduce", "allreduce")
    assert op_kind(torch.ops._c10d_functional.reduce_scatter_tensor.default)[0] == "reduce_scatter"
    assert op_kind(torch.ops.c10d._allgather_base_.default) == ("all_gather", "_allgather_base")
    assert op_kind(torch.ops.aten.mm.default) is None


def test_cli_json_report_carries_the_twin():
    from parlab.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["run", "collectives", "--world", "2", "--numel", "64", "--json"])
    report = json.loads(out.getvalue())
    assert status == 0 and report["twin"]["passed"] and report["twin"]["name"] == "dist.all_reduce"
