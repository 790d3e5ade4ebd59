"""Lesson 11 (notebooks/11_fault_tolerance.ipynb): failures at scale, checkpoints, and surviving a dead rank.

The machinery is elsewhere: sharded checkpoints in parlab/schemes/faults/checkpoint.py, the dying rank and the tolerant
server in parlab/schemes/faults/failures.py, the runs (`python -m parlab run dp|zero|ps --kill-rank R --at-step S`) in
parlab/runs/checkpoint.py. This module holds the lesson's arithmetic tables and figures:

    failures at scale        `mtbf_rows`, `draw_mtbf`: a job's mean time between failures, 1 to 100,000 devices
    how often to save        `young_rows`, `draw_waste`: time lost to saving + redoing, and Young's interval
    what a checkpoint costs  `checkpoint_bytes_rows`: bytes each rank wrote (measured) beside the formula
    a live failure           `draw_failure`: the loss curve of a run whose rank died, and of the restart
    sync vs async            `async_rows`: what the parameter server did without its dead worker
"""

from __future__ import annotations

from parlab.schemes.faults.checkpoint import checkpoint_bytes
from parlab.schemes.faults.failures import job_mtbf, wasted_fraction, young_interval

HOUR = 3600.0
DEVICE_MTBF_HOURS = 50_000.0  # one accelerator with its share of host, link and power: ~5.7 years between failures


def mtbf_rows(devices=(1, 8, 64, 1024, 16_384, 100_000), device_mtbf_hours: float = DEVICE_MTBF_HOURS) -> list[dict]:
    """For each job size: hours between failures (any device failing stops a synchronous job), and failures
    per day. MTBF_job = MTBF_device / n for independent failures."""
    rows = []
    for n in devices:
        hours = job_mtbf(device_mtbf_hours, n)
        rows.append({"devices": n, "job_mtbf_hours": hours, "failures_per_day": 24 / hours})
    return rows


def draw_mtbf(device_mtbf_hours: float = DEVICE_MTBF_HOURS):
    """Log-log curve: a job's MTBF (hours) against its number of devices."""
    import plotly.graph_objects as go

    from parlab.views import plots

    ns = [2**k for k in range(0, 18)]
    hours = [job_mtbf(device_mtbf_hours, n) for n in ns]
    fig = go.Figure(
        go.Scatter(
            x=ns,
            y=hours,
            mode="lines+markers",
            line={"color": plots.SERIES_COLORS["parlab"]},
            hovertemplate="%{x} devices<br>a failure every %{y:.2f} h<extra></extra>",
        )
    )
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    title = f"A job fails n times as often as one device (MTBF {device_mtbf_hours:,.0f} h each)"
    return plots.style(fig, title, "devices n", "hours between failures of the job")


def young_rows(save_seconds: float, mtbf_seconds: float, intervals=(60, 300, 900, 3600, 4 * 3600)) -> list[dict]:
    """Time lost at each checkpoint interval (first order): saving delta / tau, redoing tau / 2M; and Young's
    optimum tau* = sqrt(2 delta M) last."""
    best = young_interval(save_seconds, mtbf_seconds)
    rows = [{"interval_s": t, "lost": wasted_fraction(t, save_seconds, mtbf_seconds)} for t in intervals]
    rows.append({"interval_s": best, "lost": wasted_fraction(best, save_seconds, mtbf_seconds), "young": True})
    return rows


def draw_waste(save_seconds: float, mtbf_seconds: float):
    """Curves of the fraction of time lost against the checkpoint interval: saving, redoing, their sum; a
    marker at Young's interval."""
    import plotly.graph_objects as go

    from parlab.views import plots

    best = young_interval(save_seconds, mtbf_seconds)
    taus = [best * 2 ** (k / 4) for k in range(-16, 17)]
    fig = go.Figure()
    parts = {
        "saving (delta / tau)": [save_seconds / t for t in taus],
        "redoing (tau / 2M)": [t / (2 * mtbf_seconds) for t in taus],
        "total": [wasted_fraction(t, save_seconds, mtbf_seconds) for t in taus],
    }
    for (name, ys), color in zip(parts.items(), plots.RANK_COLORS, strict=False):
        fig.add_trace(go.Scatter(x=[t / 60 for t in taus], y=ys, name=name, mode="lines", line={"color": color}))
    young = f"Young: tau* = {best / 60:.1f} min"
    lost = wasted_fraction(best, save_seconds, mtbf_seconds)
    fig.add_trace(go.Scatter(x=[best / 60], y=[lost], mode="markers", name=young, marker={"size": 12}))
    fig.update_xaxes(type="log")
    title = f"How often to save: delta = {save_seconds:g} s per checkpoint, MTBF {mtbf_seconds / HOUR:.2f} h"
    return plots.style(fig, title, "checkpoint interval tau (minutes)", "fraction of the time lost")


def checkpoint_bytes_rows(report: dict, psi: int, elem_bytes: int = 8) -> list[dict]:
    """What each survivor of a failure run read back (bytes, measured by parlab.schemes.faults.checkpoint.Reader),
    beside the formula: the state (weights, m, v: 3 Psi elements) divided among the ranks that hold distinct parts."""
    layout = "dp" if report["scheme"] in ("dp", "dp-naive") else "zero"
    state_bytes = (3 if report.get("optimizer", "adam") == "adam" else 1) * elem_bytes  # (weights, m, v) or weights
    theory = checkpoint_bytes(psi, report["restarted_on"], layout, state_bytes)
    return [
        {"rank": r, "read_bytes": b, "formula_bytes": theory} for r, b in enumerate(report["checkpoint_bytes_per_rank"])
    ]


def draw_failure(report: dict):
    """The loss of each step: the uninterrupted run, the run that failed (to the step before the failure: the
    same numbers, the same ranks and data), and the restart from the checkpoint on the survivors."""
    import plotly.graph_objects as go

    from parlab.views import plots

    K, at, resumed = report["steps"], report["at_step"], report["resumed_from"]
    steps = list(range(1, K + 1))
    fig = go.Figure()
    P = report["world_size"]
    dotted = {"color": plots.SERIES_COLORS["single device"], "dash": "dot"}
    fig.add_trace(go.Scatter(x=steps, y=report["loss_uninterrupted"], name=f"uninterrupted ({P} ranks)", line=dotted))
    before = report["loss_uninterrupted"][: at - 1]
    fig.add_trace(
        go.Scatter(
            x=steps[: at - 1],
            y=before,
            name=f"before the failure ({report['world_size']} ranks)",
            mode="lines+markers",
            line={"color": plots.rank_color(0)},
        )
    )
    fig.add_vline(
        x=at,
        line={"color": plots.rank_color(5), "dash": "dash"},
        annotation_text=f"rank {report['killed_rank']} dies in step {at}",
    )
    fig.add_trace(
        go.Scatter(
            x=steps[resumed:],
            y=report["loss_after_restart"],
            mode="lines+markers",
            name=f"restart from step {resumed} ({report['restarted_on']} ranks)",
            line={"color": plots.rank_color(2)},
        )
    )
    return plots.style(fig, "A rank dies; training resumes from the last checkpoint", "step", "loss (nats)")


def async_rows(report: dict) -> list[dict]:
    """The asynchronous server's updates per worker: the dead one stops, the others go on."""
    workers = sorted({u["worker"] for u in report["updates"]} | set(report["dead"]))
    return [
        {
            "worker": w,
            "gradients_applied": sum(u["worker"] == w for u in report["updates"]),
            "dead": w in report["dead"],
        }
        for w in workers
    ]
