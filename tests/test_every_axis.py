"""Every scheme with every axis at 1 and at its smallest legal size (issue 41, done-when): each run passes, with its
PyTorch twin, or is refused in one line; none ends in a traceback.

An axis of size 1 is where the bugs hid: torch's DeviceMesh hands an axis as large as the world the default group,
which bears no axis name (usp measured 0 bytes on it), and a twin built its mesh without the cp axis (hybrid). The
runs are as small as each scheme allows (one step, the fewest layers): what is checked is that every combination
runs and passes, not the numbers of a big one (each scheme's own tests do that)."""

from __future__ import annotations

import json

import pytest
from cli_in_process import run_cli

from parlab.runs.registry import all_schemes

SMALL = ["--steps", "1", "--layers", "1"]  # the reference GPT at its smallest: one block, one step

# (scheme, options): every axis at 1, then each at its smallest size above 1 with the others at 1.
RUNS = [
    ("collectives", ["--world", "1", "--steps", "1"]),
    ("collectives", ["--world", "2", "--steps", "1"]),
    *[(s, ["--world", w, *SMALL]) for s in ("dp", "dp-naive", "tp", "ulysses", "ring", "ring-zigzag") for w in "12"],
    ("megatron-sp", ["--world", "2", *SMALL]),  # 1 is refused below: SP splits a tp group
    ("pp", ["--world", "1", *SMALL]),
    ("pp", ["--world", "2", "--steps", "1", "--layers", "2", "--microbatches", "2", "--batch", "4"]),
    ("usp", ["--world", "1", "--ulysses", "1", "--ring", "1", *SMALL]),
    ("usp", ["--world", "2", "--ulysses", "2", "--ring", "1", *SMALL]),
    ("usp", ["--world", "2", "--ulysses", "1", "--ring", "2", *SMALL]),
    *[("zero", ["--world", w, *SMALL]) for w in "12"],
    ("zero", ["--world", "2", "--stage", "3", *SMALL]),
    *[("offload", ["--world", w, *SMALL]) for w in "12"],
    ("hybrid", ["--dp", "1", "--pp", "1", "--cp", "1", "--tp", "1", *SMALL]),
    ("hybrid", ["--dp", "2", "--pp", "1", "--cp", "1", "--tp", "1", *SMALL]),
    ("hybrid", ["--dp", "1", "--pp", "2", "--cp", "1", "--tp", "1", "--steps", "1", "--layers", "2"]),
    ("hybrid", ["--dp", "1", "--pp", "1", "--cp", "2", "--tp", "1", *SMALL]),
    ("hybrid", ["--dp", "1", "--pp", "1", "--cp", "2", "--tp", "1", "--cp-method", "usp", *SMALL]),
    ("hybrid", ["--dp", "1", "--pp", "1", "--cp", "1", "--tp", "2", *SMALL]),
    ("hybrid", ["--dp", "2", "--pp", "1", "--cp", "1", "--tp", "1", "--experts", "2", "--ep", "2", *SMALL]),
    ("ps", ["--world", "2", *SMALL]),  # 1 is refused below: a server and no worker
    ("moe", ["--world", "1", *SMALL]),
    ("moe", ["--world", "2", "--dp", "1", *SMALL]),
    ("moe", ["--world", "2", "--dp", "2", *SMALL]),
]

REFUSED = [
    ("megatron-sp", ["--world", "1"], "--world 1 gives no tensor"),
    ("ps", ["--world", "1"], "a parameter server needs at least 2 ranks"),
]


def test_every_scheme_is_run_here():
    assert {scheme for scheme, _ in RUNS} == set(all_schemes())


@pytest.mark.parametrize("scheme, argv", RUNS, ids=[f"{s}:{' '.join(a)}" for s, a in RUNS])
def test_every_axis_at_one_and_at_its_smallest_size_runs_and_passes(scheme, argv):
    out = run_cli("run", scheme, *argv, "--json")
    assert out.returncode == 0 and "Traceback" not in out.stderr, (out.stderr[-3000:], out.stdout[-3000:])
    report = json.loads(out.stdout)
    assert report["passed"], report["verdicts"]
    twin = report["twin"]
    assert twin.get("passed") or "skipped" in twin, twin  # a twin that ran agrees; one that cannot says why
    # Where torch itself refuses on a CPU (causal context_parallel, CPUOffloadPolicy: the README), and nowhere else:
    # a twin that misuses torch (hybrid's left the cp ranks out of its mesh) read "torch refused" too.
    refuses_on_cpu = ("ulysses", "ring", "ring-zigzag", "usp", "offload")
    assert "torch refused" not in twin.get("skipped", "") or scheme in refuses_on_cpu, twin


@pytest.mark.parametrize("scheme, argv, message", REFUSED, ids=[s for s, _, _ in REFUSED])
def test_an_axis_a_scheme_cannot_take_is_refused_in_one_line(scheme, argv, message):
    out = run_cli("run", scheme, *argv)
    err = out.stderr.strip()
    assert out.returncode == 2 and err.startswith("parlab: error: ") and len(err.splitlines()) == 1, err
    assert message in err
