"""Tensor parallelism against the unsharded reference: layer by layer, the whole GPT, bytes, bad input, CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cli_in_process import run_cli

import parlab
from parlab.core.check import compare
from parlab.core.models import GPTConfig, build_model, param_bytes
from parlab.lessons import tensor_parallel as lesson
from parlab.lessons import tensor_parallel_memory as memory_lesson
from parlab.runs.registry import run_scheme
from parlab.runs.tensor_parallel import run_tp
from parlab.schemes import tensor_parallel as tp

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- layer by layer


@pytest.mark.parametrize("world_size, dtype", [(4, "float64"), (2, "float32")])
def test_each_layer_matches_its_unsharded_counterpart(world_size, dtype):
    out = lesson.check_layers(world_size, dtype)
    assert [v.what.split(":")[0] for v in out["verdicts"]] == list(lesson.LAYERS)  # every layer really ran
    for verdict in out["verdicts"]:
        assert verdict.passed, verdict.line
        assert verdict.max_abs_err <= (1e-10 if dtype == "float64" else 1e-5)
    for check in out["comm"]:
        assert check.passed, check.line
    # The vocab-parallel loss never gathers the logits; the naive one does, and moves V/P x B x T numbers.
    gathers = {e.label for e in out["results"].trace.select(kind="all_gather")}
    assert gathers == {"gather fwd column gathered", "gather fwd naive loss"}


def _column_without_f(cfg: GPTConfig, seed: int) -> torch.Tensor:
    """Rank code: a column-parallel fc with f left out; returns this rank's dL/dx."""
    rank, P = dist.get_rank(), dist.get_world_size()
    full = build_model(cfg, seed)
    inputs = lesson.layer_inputs(cfg, 2, seed)
    layer = tp.ColumnParallelLinear(full.blocks[0].mlp.fc, copy_input=False)
    x = inputs["x"].clone().requires_grad_()
    (layer(x) * inputs["dy_F"].chunk(P, dim=-1)[rank]).sum().backward()
    return x.grad


def test_leaving_out_f_gives_a_partial_gradient_that_the_check_catches():
    cfg = lesson.layer_config()
    partial = parlab.launch(_column_without_f, 4, cfg, 0, echo=False)
    full, inputs = build_model(cfg, 0), lesson.layer_inputs(cfg, 2, 0)
    x = inputs["x"].clone().requires_grad_()
    (full.blocks[0].mlp.fc(x) * inputs["dy_F"]).sum().backward()
    assert not compare("without f", partial[0], x.grad).passed  # one rank's share is not dL/dx
    assert compare("sum of the shares", sum(partial), x.grad).passed  # f's all-reduce restores it


# ------------------------------------------------------------------------------------------------ the GEMM split


@pytest.mark.parametrize("split", lesson.SPLITS)
def test_gemm_split(split):
    M, K, N, P = 4, 8, 8, 4
    results = lesson.show_gemm_split(split, P, M, K, N)
    A, B = lesson.gemm_inputs(M, K, N)
    for r, held in enumerate(results):
        assert compare(f"C on rank {r}", held["C"], A @ B).passed
    bytes_ = results.trace.bytes_per_rank()
    if split == "columns":  # each rank contributes its [M, N/P] block to the all-gather
        assert bytes_ == {"all_gather": [M * N // P * 8] * P}
        assert [h["B"].shape for h in results] == [torch.Size([K, N // P])] * P
    else:  # each rank all-reduces a full [M, N] partial sum
        assert bytes_ == {"all_reduce": [M * N * 8] * P}
        assert [h["A"].shape for h in results] == [torch.Size([M, K // P])] * P


# ------------------------------------------------------------------------------------------------- the whole GPT


def test_gpt_float32_tied_matches_single_device_after_k_steps():
    results, report = run_tp(2, dtype="float32", tied=True, steps=2, layers=1)
    assert report["passed"], "\n".join(report["verdicts"])
    assert report["max_abs_err"] <= 1e-5 and report["tol"] == 1e-5
    # tied: the LM head has no weight of its own, and rank r's embedding slice is [V/P, H]
    assert "lm_head.weight" not in results[0]["params"]
    assert results[1]["params"]["wte.weight"].shape == (64 // 2, 32)


def test_gpt_adam_float64_matches_single_device():
    _, report = run_tp(4, optimizer="adam", lr=0.01, steps=2, layers=1, batch=2)
    assert report["passed"], "\n".join(report["verdicts"])
    assert report["max_abs_err"] <= 1e-10


@pytest.mark.parametrize("tied", [False, True])
def test_param_bytes_theory_at_one_rank_is_the_single_device_model(tied):
    cfg = GPTConfig(tied=tied)
    assert tp.param_bytes_theory(cfg, 1) == param_bytes(build_model(cfg))


def test_param_bytes_measured_per_world_size():
    cfg = lesson.layer_config()
    measured = memory_lesson.measure_param_bytes(cfg, (1, 2, 8))
    assert measured[1] == [param_bytes(build_model(cfg))]
    for P, per_rank in measured.items():
        assert per_rank == [tp.param_bytes_theory(cfg, P)] * P
    assert measured[8][0] > measured[1][0] / 8  # the replicated parameters keep it above 1/P


# --------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"heads": 6, "hidden": 36}, "heads=6 is not divisible by world_size=4"),
        ({"hidden": 34, "heads": 2}, "hidden=34 is not divisible by world_size=4"),
        ({"ffn": 66}, "ffn=66 is not divisible by world_size=4"),
        ({"vocab": 30}, "vocab=30 is not divisible by world_size=4"),
        ({"world_size": 3}, "heads=4 is not divisible by world_size=3"),
    ],
)
def test_bad_sizes_are_refused_before_launch(monkeypatch, changes, message):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr("parlab.runs.registry.launch", no_launch)
    with pytest.raises(ValueError, match=message):
        run_scheme("tp", **{"world_size": 4, **changes})


def test_lesson_demos_refuse_bad_sizes_before_launch(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(lesson, "launch", no_launch)
    with pytest.raises(ValueError, match="heads=8 is not divisible by world_size=3"):
        lesson.check_layers(3)
    with pytest.raises(ValueError, match="heads=8 is not divisible by world_size=3"):
        memory_lesson.measure_param_bytes(lesson.layer_config(), (2, 3))  # every size checked before the first launch
    with pytest.raises(ValueError, match="ffn=18 is not divisible by world_size=4"):
        lesson.megatron_figure("mlp", 4, hidden=8, ffn=18)


# ---------------------------------------------------------------------------------------------------- the CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli("run", "tp", *args)


def test_cli_json_world_4():
    proc = _cli("--world", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for key in ("scheme", "world_size", "passed", "max_abs_err", "tol", "comm", "verdicts"):
        assert key in report
    assert report["passed"] is True and report["world_size"] == 4 and report["max_abs_err"] <= 1e-10
    L, B, T, H, steps, e = report["layers"], report["batch"], report["seq"], report["hidden"], 3, 8
    assert (L, B, T, H) == (2, 4, 16, 32)
    layers = 4 * L * B * T * H * e  # Megatron: 2 all-reduces forward + 2 backward per layer, [B, T, H] each
    vocab_terms = {
        "g fwd embed": B * T * H * e,
        "f bwd lm_head": B * T * H * e,
        "loss max": B * T * e,
        "loss sum-exp": B * T * e,
        "loss target logit": B * T * e,
    }
    items = report["comm"]["items_per_step"]
    assert {k: v["measured"] for k, v in items.items() if k in vocab_terms} == {
        k: [v] * 4 for k, v in vocab_terms.items()
    }
    assert report["comm"]["layers_all_reduce_per_step"] == [layers] * 4
    assert report["comm"]["all_reduce"] == [steps * (layers + sum(vocab_terms.values()))] * 4  # whole run
    assert set(report["comm"]) >= {"all_reduce"} and "all_gather" not in report["comm"]
    assert report["param_bytes_per_rank"] == [report["param_bytes_per_rank_theory"]] * 4
    assert report["param_bytes_per_rank"][0] < report["param_bytes_single_device"]
