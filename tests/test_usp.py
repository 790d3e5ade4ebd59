"""USP (Ulysses x ring on a 2D mesh) against the unsharded reference: attention vs scaled_dot_product_attention
(outputs and q/k/v gradients, float64), where Ulysses alone is refused; bytes per mesh axis vs theory; a GPT
training run vs one device; bad input before launch; the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_in_process import run_cli

import parlab
from parlab.core.check import compare
from parlab.core.mesh import DeviceMesh
from parlab.runs.registry import run_scheme
from parlab.schemes.sequence.usp import usp_attention, usp_bytes_per_call, usp_merge, usp_mesh_axes, usp_split

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (2, 2, 16, 4)  # B, nh = 2 (not divisible by P = 4: Ulysses alone is refused), T, hs
CASES = [(layout, causal) for layout in ("contiguous", "zigzag") for causal in (True, False)]


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=gen, dtype=torch.float64) for _ in range(4)]  # q, k, v, dL/dout


def _usp_rank(ulysses, ring):
    mesh = DeviceMesh(usp_mesh_axes(ulysses, ring))
    g, u = mesh.index("ring"), mesh.index("ulysses")
    q, k, v, dout = _inputs()
    out = {}
    for layout, causal in CASES:
        mine = [usp_split(t, g, u, ring, ulysses, 2, layout).clone().requires_grad_() for t in (q, k, v)]
        o = usp_attention(*mine, causal=causal, ulysses_group=mesh.group("ulysses"), ring_group=mesh.group("ring"),
                          layout=layout)  # fmt: skip
        (o * usp_split(dout, g, u, ring, ulysses, 2, layout)).sum().backward()
        out[(layout, causal)] = [o.detach()] + [t.grad for t in mine]
    return out


def _reference(causal):
    q, k, v, dout = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (o * dout).sum().backward()
    return [o.detach(), q.grad, k.grad, v.grad]


@pytest.fixture(scope="module")
def usp_run():
    return parlab.launch(_usp_rank, 4, 2, 2, echo=False)


@pytest.mark.parametrize("layout, causal", CASES)
def test_usp_matches_sdpa_float64_where_ulysses_alone_cannot_run(usp_run, layout, causal):
    ref = _reference(causal)
    for i, name in enumerate(("output", "dq", "dk", "dv")):
        got = usp_merge([r[(layout, causal)][i] for r in usp_run], 2, 2, 2, layout)
        verdict = compare(f"usp {layout} causal={causal} {name}", got, ref[i])
        assert verdict.passed and verdict.max_abs_err <= 1e-10, verdict.line


def test_usp_bytes_per_axis_match_theory(usp_run):
    B, nh, T, hs = SHAPE
    theory = usp_bytes_per_call(B, nh, T, hs, 2, 2, 8)
    calls = len(CASES)
    for r in range(4):
        a2a = [e for e in usp_run.trace.select(rank=r, axis="ulysses") if e.kind == "all_to_all"]
        sends = [e for e in usp_run.trace.select(kind="send", rank=r)]
        assert {e.axis for e in sends} == {"ring"} and len(a2a) == 8 * calls
        assert sum(e.bytes for e in a2a) == calls * theory["ulysses"]
        assert sum(e.bytes for e in sends) == calls * theory["ring"]
        assert {e.bytes for e in sends} == {2 * B * (nh // 2) * (T // 2) * hs * 8}  # [2, B, nh/U, T/R, hs]
    peers = {(e.rank, e.peer) for e in usp_run.trace.select(kind="send")}
    assert peers == {(0, 2), (2, 0), (1, 3), (3, 1)}  # the ring runs across the ulysses groups {0, 1}, {2, 3}


def test_usp_split_and_merge_zigzag():
    x = torch.arange(16).view(1, 16)
    blocks = [usp_split(x, r // 2, r % 2, 2, 2, 1, "zigzag") for r in range(4)]
    assert [b.tolist()[0] for b in blocks] == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert torch.equal(usp_merge(blocks, 2, 2, 1, "zigzag"), x)


def test_gpt_training_matches_single_device_heads_2_on_4_ranks():
    from parlab.runs.usp import run_usp

    _, report = run_usp(2, 2, layout="zigzag", steps=2, layers=1, heads=2)
    assert report["passed"], "\n".join(report["verdicts"])
    assert report["max_abs_err"] <= 1e-10
    comm = report["comm"]
    assert comm["ulysses_per_step"] == [comm["ulysses_per_step_theory"]] * 4
    assert comm["ring_per_step"] == [comm["ring_per_step_theory"]] * 4
    assert report["tiles_computed_per_rank"] == [5] * 4  # zigzag on a ring of 2: 2R + 1 tiles each


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ulysses": 2, "ring": 3}, "ulysses=2 x ring=3 = 6 ranks, but world_size=4"),
        ({"ulysses": 4, "ring": 1, "heads": 2}, "heads=2 is not divisible by ulysses=4"),
        ({"ulysses": 2, "ring": 2, "seq": 18}, "seq=18 is not divisible by world_size=4"),
        ({"ulysses": 1, "ring": 4, "seq": 20, "layout": "zigzag"}, "seq=20 is not divisible by 2 x ring = 8"),
    ],
)
def test_bad_input_is_refused_before_launch(monkeypatch, changes, message):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr("parlab.runs.registry.launch", no_launch)
    with pytest.raises(ValueError, match=message):
        run_scheme("usp", **{"world_size": 4, **changes})


def test_cli_usp_json_and_one_error_line(capsys):
    from parlab.cli import main

    proc = run_cli("run", "usp", "--ulysses", "2", "--ring", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] is True and report["scheme"] == "usp"
    assert (report["ulysses"], report["ring"]) == (2, 2)
    bad = ["run", "usp", "--heads", "8", "--hidden", "24", "--ulysses", "3", "--ring", "1", "--world", "3"]
    assert main(bad) == 2  # refused before any process starts
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parlab: error:") and "--ulysses 3" in lines[0], lines
