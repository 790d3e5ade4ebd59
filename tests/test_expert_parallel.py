"""Expert parallelism against one device: the MoE GPT trained on 2 and 4 ranks (and DP x EP) matches one device
in float64; the routing matches a plain loop; the all-to-all bytes equal an independent count of what the ranks
hand to the process group; bad input; the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from cli_in_process import run_cli

from parlab.core.moe import MoEConfig, capacity, route
from parlab.runs.expert_parallel import MoEOptions, moe_rank, moe_report, run_moe
from parlab.runs.registry import run_scheme
from parlab.runtime.launcher import launch

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"steps": 1, "layers": 2, "batch": 8}


@pytest.mark.parametrize(
    "world, dp, k, drop",
    [(2, 1, 1, True), (2, 1, 2, False), (4, 1, 2, True), (4, 1, 1, False), (4, 2, 2, True), (4, 2, 1, False)],
)
def test_training_matches_one_device(world, dp, k, drop):
    capacity = {"capacity_factor": 1.0} if drop else {}  # with drop off it changes nothing, and is refused
    _, report = run_moe(world, dp=dp, top_k=k, drop=drop, experts=8, **capacity, **SMALL)
    assert report["passed"], report["verdicts"]
    assert report["max_abs_err"] <= 1e-10 and report["tol"] == 1e-10
    assert len(report["verdicts"]) == 5 + 2 * dp  # loss, aux, grads + params per replica, 2 routing, bytes
    dropped = report["dropped_tokens"]["total"]
    assert dropped > 0 if drop else dropped == 0  # the capacity path really ran (or really did not)
    assert report["aux_loss"][0] > 0


def test_a_different_grouping_differs():
    """The check can fail: one device routing the batch as ONE capacity group drops other tokens than 4 ranks do."""
    from parlab.core.check import compare
    from parlab.core.models import make_batches, train_single_device

    results, report = run_moe(4, top_k=2, capacity_factor=1.0, **SMALL)
    opts = MoEOptions.make(world_size=4, top_k=2, capacity_factor=1.0, **SMALL)
    cfg = opts.gpt_config()
    one_group = cfg.__class__(**{**cfg.__dict__, "moe": MoEConfig(8, 2, 1.0, groups=1)})
    other = train_single_device(one_group, make_batches(cfg, 8, 1))
    params = {n: p for r in results for n, p in r["params"].items()}
    assert report["passed"] and not compare("params", params, other.params).passed


def _route_by_hand(x, router, cfg):
    """The routing rule written as a loop: first choices before second ones, earlier tokens first."""
    probs = router(x).softmax(-1)
    p, expert = probs.topk(cfg.top_k, dim=-1)
    used, keep = [0] * cfg.experts, torch.zeros_like(expert, dtype=torch.bool)
    C = math.ceil(cfg.capacity_factor * x.shape[0] * cfg.top_k / cfg.experts)
    for j in range(cfg.top_k):
        for i in range(x.shape[0]):
            e = int(expert[i, j])
            keep[i, j] = used[e] < C
            used[e] += 1
    return expert, keep


@pytest.mark.parametrize("k, factor", [(1, 1.0), (2, 0.5), (2, 1.25), (3, 2.0)])
def test_route_matches_a_plain_loop(k, factor):
    torch.manual_seed(0)
    cfg = MoEConfig(experts=4, top_k=k, capacity_factor=factor)
    x, router = torch.randn(24, 8, dtype=torch.float64), torch.nn.Linear(8, 4, bias=False).double()
    routing = route(x, router, cfg)
    expert, keep = _route_by_hand(x, router, cfg)
    assert torch.equal(routing.expert, expert) and torch.equal(routing.keep, keep)
    assert capacity(24, cfg) == math.ceil(factor * 24 * k / 4)
    if k > 1:
        assert torch.allclose(routing.gates.sum(-1), torch.ones(24, dtype=torch.float64))
    f, mean_p = routing.load.double() / (24 * k), router(x).softmax(-1).mean(0)
    assert routing.aux.item() == pytest.approx(4 * (f * mean_p).sum().item(), abs=1e-15)  # E sum_e f_e P_e
    assert routing.load.sum().item() == 24 * k


def _counted_rank(opts):
    """Rank code: the moe rank, with every process-group all_to_all_single call recorded (input bytes)."""
    from torch._C._distributed_c10d import ProcessGroup

    from parlab.core.probe import wrapped

    sent = []
    name = "all_to_all_single" if hasattr(ProcessGroup, "all_to_all_single") else "alltoall_base"

    def wrap(_, original):
        def recorded(self, output, tensor, *args, **kwargs):
            sent.append(tensor.numel() * tensor.element_size())  # what this rank hands over (its input)
            return original(self, output, tensor, *args, **kwargs)

        return recorded

    with wrapped(ProcessGroup, {name: getattr(ProcessGroup, name)}, wrap):
        out = moe_rank(opts)
    out["counted"] = sum(sent)
    out["calls"] = len(sent)
    return out


def test_all_to_all_bytes_equal_an_independent_count():
    opts = MoEOptions.make(world_size=4, experts=8, top_k=2, **SMALL)
    opts.validate()
    results = launch(_counted_rank, 4, opts, echo=False)
    report = moe_report(opts, results)
    assert report["passed"], report["verdicts"]
    counted = [r["counted"] for r in results]
    assert report["all_to_all_bytes"] == counted == report["all_to_all_theory"]
    # 1 step x 2 layers x (counts, dispatch, combine, and the backward's combine and dispatch)
    assert all(r["calls"] == 2 * 5 for r in results)
    bal = report["all_to_all_balanced"]["per_layer_direction"]
    assert bal["payload"] == 32 * 2 * 32 * 8 and bal["wire"] == bal["payload"] * 3 / 4


@pytest.mark.parametrize(
    "options, message",
    [
        ({"experts": 6}, "not divisible by the 4 expert-parallel ranks"),
        ({"top_k": 9}, "top_k=9 must be between 1 and experts=8"),
        ({"capacity_factor": 0.0}, r"capacity_factor=0(\.0)? must be in \(0, 1000\]"),
        ({"dp": 3}, "not divisible by dp=3"),
    ],
)
def test_bad_input_is_refused_before_launch(options, message):
    with pytest.raises(ValueError, match=message):
        run_scheme("moe", world_size=4, **options)


def test_cli_error_is_one_line(capsys):
    from parlab.cli import main

    assert main(["run", "moe", "--world", "4", "--experts", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parlab: error: --experts 6 is not divisible"), err


def test_cli_json():
    done = run_cli("run", "moe", "--world", "4", "--experts", "8", "--top-k", "2", "--steps", "1", "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["passed"] and report["max_abs_err"] <= 1e-10
    for key in ("tokens_per_expert", "dropped_tokens", "all_to_all_bytes", "all_to_all_theory", "aux_loss"):
        assert key in report
    assert report["all_to_all_bytes"] == report["all_to_all_theory"]


def test_lesson_helpers_count_what_routing_did():
    from parlab.lessons import expert_parallel as lesson

    probs, routing, cap = lesson.routing_demo(tokens=12, experts=4, top_k=2, capacity_factor=1.0)
    assert cap == 6 and torch.equal(routing.keep, lesson.slots(routing) < cap)  # a slot past capacity: dropped
    x, router = lesson.first_layer_routing(MoEOptions.make(world_size=4).gpt_config())
    rows = lesson.capacity_rows(x, router, experts=8, top_k=2, factors=[0.5, 1.0, 2.0])
    for r in rows:
        assert r["dropped"] + r["kept"] == 128 * 2 and r["padding"] == 8 * r["capacity"] - r["kept"]
    assert [r["dropped"] for r in rows] == sorted((r["dropped"] for r in rows), reverse=True) and rows[-1][
        "dropped"
    ] == 0
    one, eight = lesson.size_rows(experts=(1, 8))  # top-2: 8 experts hold 8 x the parameters, a token uses ~2 x
    assert eight["params"] == 8 * one["params"] and eight["active"] == 2 * one["active"] + 6 * 4096
