"""Sequence parallelism against the unsharded reference: attention on 4 ranks vs scaled_dot_product_attention,
a GPT training step per method vs one device, measured bytes and tiles vs theory, bad input, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cli_in_process import run_cli

import parlab
from parlab.core.check import compare
from parlab.core.mesh import DeviceMesh
from parlab.runs.registry import run_scheme
from parlab.runs.sequence_parallel import run_sp
from parlab.schemes.sequence.ring_attention import (
    attend_tile,
    merge_partials,
    ring_attention,
    sequence_split,
    tiles_theory,
    zigzag_merge,
    zigzag_split,
)
from parlab.schemes.sequence.ulysses import ulysses_attention

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    (m, lay, c)
    for m, lay in (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous"))
    for c in (True, False)
]
SHAPE = (2, 4, 16, 8)  # B, nh, T, hs


def _inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4)]  # q, k, v, dL/dout


def _attention(method, layout):
    if method == "ulysses":
        return ulysses_attention
    return lambda q, k, v, causal, group: ring_attention(q, k, v, causal=causal, group=group, layout=layout)


def _attention_rank(cases, dtype, axes=None):
    """Rank code: every case on this rank's sequence block (of `group`: the world, or the mesh's "sp" axis)."""
    group = None if axes is None else DeviceMesh(axes).group("sp")
    r, P = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, dout = _inputs(dtype)
    out = {}
    for method, layout, causal in cases:
        mine = [sequence_split(t, r, P, 2, layout).clone().requires_grad_() for t in (q, k, v)]
        o = _attention(method, layout)(*mine, causal=causal, group=group)
        (o * sequence_split(dout, r, P, 2, layout)).sum().backward()
        out[(method, layout, causal)] = [o.detach()] + [t.grad for t in mine]
    return out


def _reference(causal, dtype):
    q, k, v, dout = _inputs(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (o * dout).sum().backward()
    return [o.detach(), q.grad, k.grad, v.grad]


def _merge(blocks, layout):
    return zigzag_merge(blocks, 2) if layout == "zigzag" else torch.cat(blocks, 2)


@pytest.fixture(scope="module")
def float64_run():
    return parlab.launch(_attention_rank, 4, CASES, torch.float64, echo=False)


@pytest.mark.parametrize("method, layout, causal", CASES)
def test_attention_on_4_ranks_matches_sdpa_float64(float64_run, method, layout, causal):
    ref = _reference(causal, torch.float64)
    for i, name in enumerate(("output", "dq", "dk", "dv")):
        got = _merge([r[(method, layout, causal)][i] for r in float64_run], layout)
        verdict = compare(f"{method} {layout} causal={causal} {name}", got, ref[i])
        assert verdict.passed and verdict.max_abs_err <= 1e-10, verdict.line


def test_ring_sends_p_minus_1_kv_blocks_per_forward(float64_run):
    block = 2 * 2 * 4 * (16 // 4) * 8 * 8  # [2, B, nh, T/P, hs] float64
    calls = 4  # the ring cases above, each one forward and one backward
    for r in range(4):
        sends = [e for e in float64_run.trace.select(kind="send", rank=r)]
        assert sum(e.label == "kv fwd" for e in sends) == calls * 3  # P-1 per forward
        assert sum(e.label == "kv bwd" for e in sends) == calls * 3  # P-1 per backward
        assert sum(e.label == "dkv bwd" for e in sends) == calls * 4  # P: the last one returns dK, dV home
        assert {e.bytes for e in sends} == {block}


def test_attention_float32_and_on_a_mesh_axis():
    """float32 within 1e-5; and group= really is the group: the "sp" axis of a dp x sp mesh."""
    cases = [("ring", "zigzag", True), ("ulysses", "contiguous", True)]
    for dtype, axes, P in ((torch.float32, None, 4), (torch.float64, {"dp": 2, "sp": 2}, 2)):
        results = parlab.launch(_attention_rank, 4, cases, dtype, axes, echo=False)
        for method, layout, causal in cases:
            ref = _reference(causal, dtype)
            for dp in range(4 // P):  # every sp group computes the whole attention
                for i in range(4):
                    got = _merge([results[dp * P + s][(method, layout, causal)][i] for s in range(P)], layout)
                    assert compare("attn", got, ref[i]).passed, (dtype, axes, method, i)
        if axes:
            peers = {(e.rank, e.peer) for e in results.trace.select(kind="send")}
            assert peers == {(0, 1), (1, 0), (2, 3), (3, 2)}  # the ring stays inside each sp group


# ----------------------------------------------------------------------------------- pieces, no processes


def test_zigzag_split_and_merge():
    x = torch.arange(16).view(1, 16)
    blocks = [zigzag_split(x, r, 4, dim=1) for r in range(4)]
    assert blocks[0].tolist() == [[0, 1, 14, 15]] and blocks[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(zigzag_merge(blocks, dim=1), x)
    with pytest.raises(ValueError, match="not divisible by 2 x world_size = 8"):
        zigzag_split(torch.zeros(1, 12), 0, 4, dim=1)


def test_tiles_theory():
    assert tiles_theory(4, "contiguous") == [1, 2, 3, 4]  # the last rank does P times the first's work
    assert tiles_theory(4, "zigzag") == [9, 9, 9, 9]  # 2P + 1 each
    assert tiles_theory(4, "zigzag", causal=False) == [16] * 4


def test_online_softmax_merge_and_a_merge_that_forgets_to_rescale():
    q, k, v, _ = _inputs(torch.float64)
    full, _ = attend_tile(q, k, v, "full")
    (oa, la), (ob, lb) = (
        attend_tile(q, k[..., :6, :], v[..., :6, :], "full"),
        attend_tile(q, k[..., 6:, :], v[..., 6:, :], "full"),
    )
    out, lse = merge_partials(oa, la, ob, lb)
    assert compare("merged", out, full).passed
    assert compare("lse", lse, torch.logsumexp(q @ k.transpose(-2, -1) / 8**0.5, -1)).passed
    assert not compare("no rescale", (oa + ob) / 2, full).passed


# ------------------------------------------------------------------------------------- the GPT, per method


@pytest.mark.parametrize("method", ["megatron-sp", "ulysses", "ring", "ring-zigzag"])
def test_gpt_training_matches_single_device(method):
    _, report = run_sp(method, 4, steps=2, layers=1)
    assert report["passed"], "\n".join(report["verdicts"])
    assert report["max_abs_err"] <= 1e-10
    assert (report["seq"], report["heads"], report["hidden"]) == (16, 4, 32)
    comm = report["comm"]
    if method == "megatron-sp":  # what all-gather + reduce-scatter send = what TP's all-reduce sends
        assert comm["layers_sent_per_step"] == [comm["tp_all_reduce_sent_per_step"]] * 4
        assert report["layernorm_saved_bytes"]["sp_per_rank"] * 4 == report["layernorm_saved_bytes"]["tp_per_rank"]
    if method.startswith("ring"):
        assert comm["kv_blocks_sent_per_forward"] == [3] * 4
        expected = [9] * 4 if method == "ring-zigzag" else [1, 2, 3, 4]
        assert report["tiles_computed_per_rank"] == expected


def test_ulysses_payload_per_rank_halves_from_2_to_4_ranks():
    _, at2 = run_sp("ulysses", 2, steps=1, layers=1)
    _, at4 = run_sp("ulysses", 4, steps=1, layers=1)
    assert at2["passed"] and at4["passed"]
    assert at4["comm"]["all_to_all_per_step"] == [at2["comm"]["all_to_all_per_step"][0] // 2] * 4


def test_float32_tied_ring_zigzag():
    _, report = run_sp("ring-zigzag", 2, dtype="float32", tied=True, steps=2, layers=1)
    assert report["passed"], "\n".join(report["verdicts"])
    assert report["tol"] == 1e-5


# --------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "method, changes, message",
    [
        ("ring", {"seq": 18}, "seq=18 is not divisible by world_size=4"),
        ("ulysses", {"seq": 18}, "seq=18 is not divisible by world_size=4"),
        ("ring-zigzag", {"seq": 20}, "seq=20 is not divisible by 2 x world_size = 8"),
        (
            "ulysses",
            {"heads": 2, "hidden": 32},
            "heads=2 is not divisible by world_size=4.*known limit.*ring attention",
        ),
        ("megatron-sp", {"world_size": 1}, "Megatron sequence parallelism runs inside a tensor-parallel group"),
        ("megatron-sp", {"seq": 18}, "seq=18 is not divisible by world_size=4"),
        ("megatron-sp", {"heads": 2}, "heads=2 is not divisible by world_size=4"),
    ],
)
def test_bad_input_is_refused_before_launch(monkeypatch, method, changes, message):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr("parlab.runs.registry.launch", no_launch)
    with pytest.raises(ValueError, match=message):
        run_scheme(method, **{"world_size": 4, **changes})


# ---------------------------------------------------------------------------------------------------- the CLI


def test_cli_ring_zigzag_json():
    proc = run_cli("run", "ring-zigzag", "--world", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for key in ("scheme", "world_size", "passed", "max_abs_err", "tol", "comm", "verdicts", "seq", "heads", "hidden"):
        assert key in report
    assert report["passed"] is True and report["scheme"] == "ring-zigzag"
    assert report["tiles_computed_per_rank"] == [9, 9, 9, 9]


# ------------------------------------------------------------------------------------- the lesson's figure data


@pytest.mark.parametrize("layout, tiles", [("contiguous", [1, 2, 3, 4]), ("zigzag", [9, 9, 9, 9])])
def test_ring_steps_are_read_from_the_trace(layout, tiles):
    from parlab.lessons import sequence_parallel as lesson

    steps = lesson.ring_steps(lesson.ring_demo(4, layout).trace, 4, layout)
    assert steps["held"] == [[(r - s) % 4 for r in range(4)] for s in range(4)]  # followed through the recvs
    assert lesson.tiles_per_rank(steps) == tiles
    n = 4 * (2 if layout == "zigzag" else 1)
    assert {(q, k) for _, _, q, k in steps["tiles"]} == {(q, k) for q in range(n) for k in range(q + 1)}  # causal
    fig = lesson.draw_ring_step(steps, 3)
    assert f"tiles so far per rank {tiles}" in fig.layout.title.text


def test_ulysses_demo_is_a_transpose():
    from parlab.lessons import sequence_parallel as lesson

    results = lesson.ulysses_demo(4, heads=4, seq=8)
    for r, held in enumerate(results):
        assert held["before"].tolist() == [100.0 * r + h for h in range(4)]  # block r, every head
        assert held["after"].tolist() == [[100.0 * s + r for s in range(4)]]  # every block, head r


def test_ring_activation_memory_grows_linearly_with_the_sequence():
    from parlab.lessons import sequence_parallel as lesson

    ring = parlab.launch(lesson.activations_rank_fn, 4, "ring", [16, 32, 64], 1, echo=False)[0]
    ulysses = parlab.launch(lesson.activations_rank_fn, 4, "ulysses", [16, 32, 64], 1, echo=False)[0]
    assert ring[64] - ring[32] == 2 * (ring[32] - ring[16])  # linear: only [B, T/P, ...] blocks are saved
    assert ulysses[64] - ulysses[32] > 2 * (ulysses[32] - ulysses[16])  # its [B, nh/P, T, T] softmax grows as T^2
