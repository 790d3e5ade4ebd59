"""Lesson 07 (notebooks/07_hybrid.ipynb): the device mesh drawn from a run, each axis' traffic, the planner.

The scheme is parlab/hybrid.py (run and checked by parlab/runs/hybrid.py); the planner is parlab/planner.py.
This module draws what a run did and tabulates what the planner estimates:

    the mesh            `mesh_figure`: every rank at its (dp, pp, tp) place, what it holds, its groups
    traffic per axis    `axis_traffic_figure`: payload bytes each rank handed over on each axis, measured beside the
                        theory (lesson 00's count; for send, the payload is what goes on the wire)
    the planner         `plan_table`: the best plans for a model and a cluster, one line each
"""

from __future__ import annotations

from parlab.hybrid import AXES
from parlab.mesh import axis_groups
from parlab.pipeline import split_layers
from parlab.planner import Cluster, ModelSpec, describe, plans


def rank_places(report: dict) -> list[dict]:
    """For each rank of a hybrid run: its coordinates, its groups on each axis and what it holds."""
    axes = report["mesh"]["axes"]
    stages = split_layers(report["layers"], axes["pp"])
    rows = []
    for rank, coords in enumerate(report["mesh"]["coords"]):
        groups = {axis: next(g for g in axis_groups(axes, axis) if rank in g) for axis in AXES}
        blocks = stages[coords["pp"]]
        holds = f"blocks {blocks.start}-{blocks.stop - 1}" + (", embeddings" if coords["pp"] == 0 else "")
        holds += ", LM head" if coords["pp"] == axes["pp"] - 1 else ""
        rows.append({"rank": rank, **coords, "groups": groups, "holds": holds})
    return rows


def mesh_figure(report: dict):
    """The mesh of a hybrid run: one panel per data-parallel replica, pipeline stages as rows, tensor-parallel
    ranks as columns. Each cell: the rank, the blocks it holds and its 1/T slice; hover: its group on each axis
    and the payload bytes it handed over on each axis (measured)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from parlab.plots import rank_color, style

    axes = report["mesh"]["axes"]
    D, S, T = axes["dp"], axes["pp"], axes["tp"]
    measured = report["comm"]["per_axis_measured"]
    fig = make_subplots(rows=1, cols=D, subplot_titles=[f"replica dp = {d}" for d in range(D)], horizontal_spacing=0.06)
    for place in rank_places(report):
        r = place["rank"]
        text = f"<b>rank {r}</b><br>{place['holds']}<br>TP slice {place['tp'] + 1}/{T}"
        hover = "<br>".join(
            [f"rank {r}: dp {place['dp']}, pp {place['pp']}, tp {place['tp']}", place["holds"]]
            + [
                f"{axis} group {place['groups'][axis]}: "
                + ", ".join(
                    f"{key.split()[1]} payload {m[r]} bytes" for key, m in measured.items() if key.startswith(axis)
                )
                for axis in AXES
            ]
        )
        fig.add_trace(
            go.Scatter(
                x=[place["tp"]],
                y=[place["pp"]],
                mode="markers+text",
                text=[text],
                textposition="middle center",
                marker={"symbol": "square", "size": 120, "color": rank_color(r), "opacity": 0.35},
                hovertext=[hover],
                hoverinfo="text",
                showlegend=False,
            ),
            row=1,
            col=place["dp"] + 1,
        )
    fig.update_xaxes(range=[-0.6, T - 0.4], tickvals=list(range(T)), title_text="tp (tensor parallel)")
    fig.update_yaxes(range=[S - 0.4, -0.6], tickvals=list(range(S)), title_text="pp (pipeline stage)", col=1)
    fig.update_yaxes(range=[S - 0.4, -0.6], tickvals=list(range(S)))
    title = f"Device mesh dp {D} x pp {S} x tp {T} = {D * S * T} ranks: who holds what"
    return style(fig, title, height=200 + 170 * S)


def axis_traffic_figure(report: dict):
    """Payload bytes each rank handed to its calls on each axis during the run (measured from the trace: each
    call's mesh axis), one panel per axis and kind of call, bars, with the theory as black markers."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from parlab.plots import kind_color, style

    measured, theory = report["comm"]["per_axis_measured"], report["comm"]["per_axis_theory"]
    what = {"dp": "gradients over the replicas", "pp": "activations and gradients", "tp": "inside each layer"}
    keys = list(measured)  # "dp all_reduce", "pp send", "tp all_reduce", ...
    titles = [f"{key.split()[0]}: {key.split()[1].replace('_', '-')} ({what[key.split()[0]]})" for key in keys]
    fig = make_subplots(rows=len(keys), cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.08)
    ranks = [f"rank {r}" for r in range(report["world_size"])]
    for row, key in enumerate(keys, start=1):
        hover = "%{x}: %{y} payload bytes measured<extra></extra>"
        fig.add_trace(go.Bar(name=f"{key} measured", x=ranks, y=measured[key], marker_color=kind_color(key.split()[1]),
                             hovertemplate=hover), row=row, col=1)  # fmt: skip
        marker = {"color": "black", "symbol": "line-ew-open", "size": 28, "line": {"width": 3}}
        fig.add_trace(go.Scatter(name="theory", showlegend=row == 1, x=ranks, y=theory[key], mode="markers",
                                 marker=marker, hovertemplate="%{x}: %{y} payload bytes in theory<extra></extra>"),
                      row=row, col=1)  # fmt: skip
        fig.update_yaxes(title_text="payload bytes", row=row, col=1)
    title = f"Payload bytes each rank handed over on each axis in {report['steps']} steps"
    return style(fig, title, height=180 + 190 * len(keys))


def plan_table(
    layers: int, hidden: int, heads: int, seq: int, vocab: int, devices: int, memory_gb: float, batch: int, top=8
) -> list[str]:
    """The planner's best plans for a (tied-embedding) GPT on `devices` devices of `memory_gb` GB. Its "comm" is
    bytes on the wire: what each device sends per step (ring all-reduces, pipeline sends, and with offload its
    copies to and from the host), lesson 00's second count."""
    model = ModelSpec(layers, hidden, heads, seq, vocab, tied=True)
    found = plans(model, Cluster(devices, memory_gb * 1e9), batch)
    fitting = sum(e.fits for e in found)
    head = f"{model.params() / 1e9:.2f}B parameters, {devices} x {memory_gb:g} GB: {fitting} of {len(found)} plans fit"
    note = "(GB/device: held per device; comm: GB each device sends on the wire per step, + host copies with offload)"
    return [head, note] + [describe(e) for e in found[:top]]
