"""The ring all-reduce, the collectives demo, and the CLI (also under torchrun)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from cli_in_process import run_cli

from parlab.lessons.collectives import COLLECTIVES, initial_chunks, show_collective
from parlab.runs.collectives import run_ring
from parlab.schemes.collectives import ring_theory_bytes


@pytest.mark.parametrize("world_size, numel", [(4, 1024), (3, 10), (2, 7), (1, 5)])
def test_ring_all_reduce_matches_the_sum_and_sends_exactly_the_theory(world_size, numel):
    results, report = run_ring(world_size, numel=numel)
    assert report["passed"], report["verdicts"]
    reference = torch.stack([r["input"] for r in results]).sum(0)
    for r in results:
        assert torch.allclose(r["ring"], reference, rtol=0, atol=1e-12)
    assert report["comm"].get("send", [0] * world_size) == ring_theory_bytes(numel, 8, world_size)


def test_ring_theory_is_2_p_minus_1_over_p_times_n_when_p_divides_n():
    for p in (2, 4, 8):
        assert ring_theory_bytes(1024, 4, p) == [2 * (p - 1) * 1024 * 4 // p] * p


def test_ring_history_shows_reduce_scatter_then_all_gather():
    results, _ = run_ring(4, numel=8, keep_history=True)
    history = results[0]["history"]
    assert len(history) == 1 + 2 * 3  # the start, then 2(P-1) steps
    # After the reduce-scatter phase rank r holds the full sum of chunk (r + 1) mod P.
    full = torch.stack([r["input"] for r in results]).sum(0).tensor_split(4)
    for rank, r in enumerate(results):
        mid = r["history"][3]
        assert torch.allclose(mid[(rank + 1) % 4], full[(rank + 1) % 4])


def _expected_after(kind, rank, P):
    rows = [initial_chunks(r, P) for r in range(P)]
    if kind == "broadcast":
        return rows[0]
    if kind == "all_reduce":
        return sum(rows)
    if kind == "reduce_scatter":
        out = torch.full((P,), float("nan"), dtype=torch.float64)
        out[rank] = sum(row[rank] for row in rows)
        return out
    if kind == "all_gather":
        return torch.stack([rows[r][r] for r in range(P)])
    if kind == "all_to_all":
        return torch.stack([rows[s][rank] for s in range(P)])
    if kind == "send_recv":
        return rows[(rank - 1) % P]


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_each_collective_moves_the_chunks_its_definition_says(kind):
    results = show_collective(kind, 4)
    for rank, r in enumerate(results):
        assert torch.equal(r["before"], initial_chunks(rank, 4))
        assert torch.allclose(r["after"], _expected_after(kind, rank, 4), equal_nan=True)
    assert results.trace.bytes_per_rank()  # the collective was traced


def _cli(*args):
    return run_cli(*args)


def test_cli_json_contract_for_collectives():
    out = _cli("run", "collectives", "--world", "4", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for key in ("scheme", "world_size", "passed", "max_abs_err", "tol", "comm"):
        assert key in report
    assert report["passed"] is True and report["world_size"] == 4
    n = report["tensor_bytes"]
    assert report["comm"]["send"] == [2 * 3 * n // 4] * 4 == report["comm"]["theory_bytes_per_rank"]


def test_cli_verdict_lines_and_bad_input():
    out = _cli("run", "collectives", "--world", "2", "--numel", "6")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("ring all-reduce, rank 0: matches single device: max |err|")
    bad = _cli("run", "collectives", "--world", "4", "--numel", "2")
    assert bad.returncode == 2
    assert "--numel 2 must be >= --world 4" in bad.stderr


def test_same_code_runs_under_torchrun():
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "parlab", "run", "collectives", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 speaks for the job
    report = json.loads(lines[0])
    assert report["passed"] is True and report["world_size"] == 2
    assert report["comm"]["send"] == [report["tensor_bytes"]] * 2  # 2(P-1)/P x N = N for P = 2
