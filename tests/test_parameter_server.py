"""Parameter server (parlab.schemes.parameter_server): synchronous mode is one device and all-reduce DP; asynchronous
mode applies every gradient, records staleness and replays exactly; the server carries N x a worker's bytes; stragglers
hold synchronous training up; bad setups are refused before any process starts."""

import json

import pytest
import torch
from cli_in_process import run_cli

from parlab.core.models import GPTConfig, build_model, make_batches, train_single_device
from parlab.runs import registry as runs
from parlab.runs.parameter_server import run_ps
from parlab.schemes import parameter_server as ps


@pytest.fixture(scope="module")
def sync_straggler():
    """Synchronous server on 4 ranks (3 workers), float64, worker 2 slowed 4x; then all-reduce DP, same workers."""
    return run_ps(4, "sync", steps=3, straggler=2, slowdown=4.0)


@pytest.fixture(scope="module")
def async_straggler():
    """Asynchronous server on 4 ranks (3 workers), worker 3 slowed 8x."""
    return run_ps(4, "async", steps=3, straggler=3, slowdown=8.0, dp=False)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------------- numerics


def test_sync_equals_one_device_and_all_reduce_dp(sync_straggler):
    results, report = sync_straggler
    assert report["passed"], report["verdicts"]
    assert report["tol"] == 1e-10 and report["max_abs_err"] <= 1e-10
    # Checked here directly too: a real single-device run on the same 12-row batches.
    cfg = GPTConfig()
    single = train_single_device(cfg, make_batches(cfg, 12, 3, 0), 0)
    server, workers = results[0], list(results)[1:]
    assert server["role"] == "server" and all(w["role"] == "worker" for w in workers)
    assert _max_diff(server["params"], single.params) <= 1e-10
    for w in workers:
        assert _max_diff(w["params"], single.params) <= 1e-10  # every worker's last pull
        assert _max_diff(w["dp"]["params"], single.params) <= 1e-10  # all-reduce DP over the same workers
    for k in range(3):  # the mean of the 3 workers' losses is the full-batch loss
        assert abs(sum(w["losses"][k] for w in workers) / 3 - single.losses[k]) <= 1e-10
    # The parameters did move, and every worker trained on its own rows.
    initial = {n: p.detach() for n, p in build_model(cfg, 0).named_parameters()}
    assert _max_diff(server["params"], initial) > 1e-4
    assert len({tuple(w["losses"]) for w in workers}) == 3
    assert report["staleness"] == [0] * 9


def test_server_carries_n_times_a_worker_bytes(sync_straggler):
    results, report = sync_straggler
    G, K, N = report["grad_bytes"], 3, 3
    assert G == 30080 * 8
    assert report["worker_bytes"] == [(2 * K + 1) * G] * N  # K pushes, K + 1 pulls of G bytes each
    assert report["server_bytes"] == N * report["worker_bytes"][0]
    table = results.trace.bytes_per_rank()
    assert table["send"][0] == N * (K + 1) * G and table["recv"][0] == N * K * G  # measured by parlab.core.comm
    assert report["comm"]["all_reduce_per_step"] == [G] * N  # all-reduce DP: one G per worker per step
    assert report["comm"]["theory_ring_sent_bytes_per_step"] == 2 * (N - 1) * G / N


def test_async_applies_every_gradient_and_replays_exactly(async_straggler):
    results, report = async_straggler
    N, K = 3, 3
    assert report["passed"], report["verdicts"]  # the replay checks are exact even though the order is not
    assert report["mode"] == "async" and report["max_abs_err"] <= 1e-10
    updates = report["updates"]
    assert len(updates) == len(report["staleness"]) == N * K
    assert sorted((u["worker"], u["step"]) for u in updates) == [(w, k) for w in (1, 2, 3) for k in range(K)]
    for v, u in enumerate(updates):  # staleness = updates applied since that worker read its parameters
        assert u["staleness"] == v - u["read_version"] >= 0
    assert report["staleness"][0] == 0  # the first update applied: nothing happened since theta_0
    assert max(report["staleness"]) >= N - 1 > 0  # all N first gradients were computed on theta_0
    assert report["server_bytes"] == N * report["worker_bytes"][0]
    assert any("one-device replay" in line for line in report["verdicts"])
    assert len(report["eval_losses"]) == N * K + 1 and len(report["update_seconds"]) == N * K


def test_async_with_one_worker_is_one_device():
    """One worker: nothing can be stale, and async SGD is plain SGD on the whole batch."""
    results, report = run_ps(2, "async", steps=3, batch=4, dp=False)
    assert report["staleness"] == [0, 0, 0]
    cfg = GPTConfig()
    single = train_single_device(cfg, make_batches(cfg, 4, 3, 0), 0)
    assert _max_diff(results[0]["params"], single.params) <= 1e-10
    assert report["server_bytes"] == report["worker_bytes"][0]  # N = 1


# ------------------------------------------------------------------------------------ stragglers on the timeline


def test_sync_workers_wait_for_the_straggler(sync_straggler):
    results, _ = sync_straggler
    trace, slow = results.trace, 2
    dp_start = results[slow]["dp"]["start"]  # the server's run first, then all-reduce DP
    spans = [e for e in trace.select(kind="compute", rank=slow) if e.label.startswith("straggler")]
    delays = [e for e in spans if e.start < dp_start]
    dp_delays = [e for e in spans if e.start >= dp_start]
    assert [e.extra["step"] for e in delays] == [e.extra["step"] for e in dp_delays] == [0, 1, 2]
    for fast in (1, 3):
        assert not [e for e in trace.select(kind="compute", rank=fast) if e.label.startswith("straggler")]
        pulls = [e for e in trace.select(kind="recv", rank=fast) if e.label == "pull params"]
        assert len(pulls) == 4
        for k in range(3):  # the server: no parameters for step k+1 before the straggler's gradient of step k
            assert pulls[k + 1].end >= delays[k].end
        # all-reduce DP: every all-reduce of a fast worker ends after the straggler's delay of that step
        reduces = trace.select(kind="all_reduce", rank=fast)
        assert len(reduces) == 3
        assert all(r.end >= d.end for r, d in zip(reduces, dp_delays, strict=True))
    # Generously: the fast workers' waiting for parameters is of the order of the straggler's delays.
    waited = sum(e.duration for e in trace.select(kind="recv", rank=1) if e.label == "pull params")
    assert waited >= 0.3 * sum(e.duration for e in delays[:2])


def test_async_fast_workers_do_not_wait(async_straggler):
    results, _ = async_straggler
    # Generously (timing): with the straggler 8x slower, both fast workers finish their 3 steps before it does.
    assert max(results[1]["end"], results[2]["end"]) < results[3]["end"]


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "world, opts, message",
    [
        (1, {}, "needs at least 2 ranks"),
        (4, {"straggler": 0, "slowdown": 2.0}, "straggler=0 is the server"),  # the Python API: its fields
        (4, {"straggler": 4, "slowdown": 2.0}, "straggler=4 does not exist: the workers are ranks 1..3"),
        (4, {"straggler": -1, "slowdown": 2.0}, "straggler=-1 does not exist"),
        (4, {"straggler": 1, "slowdown": 0.5}, r"slowdown=0.5 must be in \[1, 1000\]"),
        (4, {"slowdown": 2.0}, "slowdown=2.0 needs a straggler"),
        (4, {"batch": 8}, "batch=8 is not divisible by the 3 workers"),
        (4, {"mode": "hogwild"}, "mode='hogwild' must be one of"),
    ],
)
def test_bad_options_fail_before_launch(monkeypatch, world, opts, message):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(runs, "launch", no_launch)
    with pytest.raises(ValueError, match=message):
        run_ps(world, **opts)


def test_cli_bad_straggler_is_refused():
    out = run_cli("run", "ps", "--world", "4", "--straggler", "0", "--slowdown", "2")
    assert out.returncode == 2 and "--straggler 0 is the server" in out.stderr


# ------------------------------------------------------------------------------------------ pieces and theory


def test_flat_vectors_round_trip():
    model = build_model(GPTConfig(), 0)
    theta = ps.params_to_vector(model)
    assert theta.shape == (30080,)
    other = build_model(GPTConfig(), 1)
    ps.vector_to_params(theta, other)
    assert torch.equal(ps.params_to_vector(other), theta)
    ps.vector_to_grads(2 * theta, other)
    assert torch.equal(ps.grads_to_vector(other), 2 * theta)


def test_theory():
    t = ps.ps_theory(grad_bytes=100, world_size=5, steps=3)
    assert t["theory_worker_bytes"] == 700 and t["theory_server_bytes"] == 2800
    assert t["theory_server_bytes_per_step"] == 4 * t["theory_worker_bytes_per_step"] == 800
    assert t["theory_ring_sent_bytes_per_step"] == 150
    # The server's link is the bottleneck beyond N = 1 + t_c beta / (2G) workers.
    assert ps.bottleneck_workers(grad_bytes=1000, compute_seconds=0.01, link_bytes_per_second=1e6) == 6


# ----------------------------------------------------------------------------------------------------------- CLI


def test_cli_json_sync_world_4_passes():
    """The issue's bar: `ps --mode sync --world 4` passes and its server carries 3 x a worker's bytes. (The async
    report is the same dict, tested in-process above.)"""
    out = run_cli("run", "ps", "--mode", "sync", "--world", "4", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["passed"] is True and report["scheme"] == "ps" and report["world_size"] == 4
    assert report["server_bytes"] == 3 * report["worker_bytes"][0] and len(report["worker_bytes"]) == 3
    assert report["staleness"] == [0] * 9 and report["max_abs_err"] <= 1e-10
    assert any("matches all-reduce DP" in line for line in report["verdicts"])


# ------------------------------------------------------------------------------------------ the lesson's figures


def test_lesson_figures_carry_the_measured_numbers(sync_straggler, async_straggler):
    from parlab.lessons import parameter_server as lesson

    results, report = sync_straggler
    bars = {trace.name: dict(zip(trace.x, trace.y, strict=True)) for trace in lesson.draw_traffic(report).data}
    measured = bars["parameter server, measured"]
    assert measured["server"] == pytest.approx(3 * measured["worker 1"])  # MB over the run
    assert measured["server"] == pytest.approx(report["server_bytes"] / 1e6)
    assert bars["all-reduce payload (measured)"]["DP rank 2"] == pytest.approx(3 * report["grad_bytes"] / 1e6)
    # The timelines: the server's phase has the pulls and pushes, the DP phase the all-reduces, each its own.
    ps_trace, dp_trace = lesson.phase_trace(results, "ps"), lesson.phase_trace(results, "dp")
    assert not ps_trace.select(kind="all_reduce") and len(ps_trace.select(kind="send", rank=0)) == 3 * 4
    assert not dp_trace.select(kind="send") and not dp_trace.select(rank=0) and dp_trace.select(kind="all_reduce")
    first_two = lesson.draw_timeline(results, "t", steps=2)
    names = {trace.name for trace in first_two.data}
    assert {"forward", "backward", "send", "recv", "compute", "optimizer step"} <= names
    pushes = [t for t in first_two.data if t.name == "send"][0]
    assert 0 < len(pushes.x) < len(ps_trace.select(kind="send"))  # cut after step 2
    _, async_report = async_straggler
    histogram = lesson.draw_staleness(async_report)
    assert sum(len(t.x) for t in histogram.data) == 9 and "straggler" in histogram.data[2].name
    curves = lesson.draw_loss_curves({"sync": report, "async": async_report}, x="updates")
    assert [len(t.y) for t in curves.data] == [4, 10]  # theta_0 .. theta_3, theta_0 .. theta_9
