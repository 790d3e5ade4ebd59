"""Lesson 01 (notebooks/01_data_parallel.ipynb): the figures and measurements around data parallelism.

The scheme itself (naive and bucketed DP, the training loop) is in parlab/schemes/data_parallel.py, and
`parlab.runs.data_parallel.run_dp` runs and checks it; this module draws what a run did:

    the loss curves          `draw_loss_curves`: one device, our DP and torch DDP, overlaid
    one step on a timeline   `draw_step`: forward, backward and the bucket all-reduces of every rank
    the overlap, counted     `overlapped_all_reduces`: all-reduces that started while backward was running
"""

from __future__ import annotations

from parlab.core.trace import Trace


def overlapped_all_reduces(trace: Trace, rank: int = 0) -> tuple[int, int]:
    """(all-reduces started while a backward span was running, all all-reduces) on one rank."""
    backward = trace.select(kind="backward", rank=rank)
    reduces = trace.select(kind="all_reduce", rank=rank)
    inside = [e for e in reduces if any(b.start <= e.start <= b.start + b.duration for b in backward)]
    return len(inside), len(reduces)


def draw_loss_curves(report: dict):
    """Plotly figure: the loss of each step on one device, with our DP and with torch DDP, overlaid."""
    import plotly.graph_objects as go

    from parlab.views import plots

    steps = list(range(1, report["steps"] + 1))
    P = report["world_size"]
    fig = go.Figure()
    curves = [
        ("one device, full batch", report["loss_single"], plots.SERIES_COLORS["single device"], "solid", 6),
        (f"our DP, {P} ranks", report["loss_parallel"], plots.SERIES_COLORS["parlab"], "dash", 3),
    ]
    if report.get("loss_ddp"):
        color = plots.SERIES_COLORS["other library"]
        curves.append((f"torch DDP, {P} ranks", report["loss_ddp"], color, "dot", 3))
    for name, losses, color, dash, width in curves:
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=losses,
                name=name,
                mode="lines+markers",
                line={"color": color, "dash": dash, "width": width},
                hovertemplate=f"{name}<br>step %{{x}}<br>loss %{{y:.12f}}<extra></extra>",
            )
        )
    title = f"Training loss, global batch {report['batch']}: one device vs {P} data-parallel ranks"
    fig.update_xaxes(dtick=1 if report["steps"] <= 20 else None)
    return plots.style(fig, title, "step", "cross-entropy loss (nats)")


def draw_step(trace: Trace, step: int, title: str):
    """Plotly timeline of one training step, every rank (parlab.views.plots.timeline): compute spans (forward,
    backward, optimizer) in the upper half of each rank's row, all-reduces below them, buckets in flight at the
    same time in stacked lanes. Times measured in the ranks."""
    from parlab.views import plots

    return plots.timeline(trace.of_step(step), title)
