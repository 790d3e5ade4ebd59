"""Lesson 07 (notebooks/07_hybrid.ipynb): the device mesh drawn from a run, each axis' traffic, the planner.

The scheme is parlab/schemes/hybrid/train.py (run and checked by parlab/runs/hybrid.py); the planner is
parlab/schemes/hybrid/planner.py. This module draws what a run did and tabulates what the planner estimates:

    the mesh            `mesh_figure`: every rank at its (dp, pp, cp, tp) place, what it holds, its groups
    a builder           `mesh_builder`: widgets for each axis' size and the options; runs the chosen mesh live
    traffic per axis    `axis_traffic_figure`: payload bytes each rank handed over on each axis, measured beside the
                        theory (lesson 00's count; for send, the payload is what goes on the wire)
    the planner         `plan_table`: the best plans for a model and a cluster, one line each
"""

from __future__ import annotations

from parlab.core.mesh import axis_groups
from parlab.schemes.hybrid.planner import Cluster, ModelSpec, describe, plans
from parlab.schemes.hybrid.train import AXES
from parlab.schemes.pipeline.executor import split_layers
from parlab.schemes.pipeline.schedules import make_schedule


def rank_places(report: dict) -> list[dict]:
    """For each rank of a hybrid run: its coordinates, its groups on each axis and what it holds."""
    axes, opts = report["mesh"]["axes"], report.get("options", {})
    schedule = make_schedule(opts.get("schedule", "1f1b"), axes["pp"], report["microbatches"], opts.get("virtual", 1))
    stages = split_layers(report["layers"], schedule.num_stages)
    rows = []
    for rank, coords in enumerate(report["mesh"]["coords"]):
        groups = {axis: next(g for g in axis_groups(axes, axis) if rank in g) for axis in AXES}
        held = [schedule.stage(coords["pp"], k) for k in range(schedule.v)]
        holds = ", ".join(f"blocks {stages[s].start}-{stages[s].stop - 1}" for s in held)
        holds += ", embeddings" if 0 in held else ""
        holds += ", LM head" if schedule.num_stages - 1 in held else ""
        if axes.get("tp", 1) > 1:
            holds += f"<br>TP slice {coords['tp'] + 1}/{axes['tp']}" + (
                " (SP: T/tp tokens)" if opts.get("sequence_parallel") else ""
            )
        if axes.get("cp", 1) > 1:
            holds += f"<br>tokens: block {coords['cp'] + 1}/{axes['cp']} ({opts.get('cp_method', 'ring')})"
        if opts.get("zero"):
            holds += f"<br>ZeRO-{opts['zero']}: 1/{axes['dp'] * axes.get('cp', 1)} of the states"
        rows.append({"rank": rank, **coords, "groups": groups, "holds": holds})
    return rows


def mesh_figure(report: dict):
    """The mesh of a hybrid run: one panel per data-parallel replica, pipeline stages as rows, the (cp, tp) ranks
    as columns. Each cell: the rank and what it holds (blocks, TP slice, tokens, ZeRO share); hover: its group on
    each axis and the payload bytes it handed over on each axis (measured)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from parlab.views.plots import rank_color, style

    axes = report["mesh"]["axes"]
    D, S, C, T = axes["dp"], axes["pp"], axes.get("cp", 1), axes["tp"]
    measured = report["comm"]["per_axis_measured"]
    fig = make_subplots(rows=1, cols=D, subplot_titles=[f"replica dp = {d}" for d in range(D)], horizontal_spacing=0.06)
    for place in rank_places(report):
        r = place["rank"]
        hover = "<br>".join(
            [f"rank {r}: " + ", ".join(f"{a} {place.get(a, 0)}" for a in AXES), place["holds"]]
            + [
                f"{axis} group {place['groups'][axis]}: "
                + ", ".join(f"{key.split()[1]} {m[r]} bytes" for key, m in measured.items() if key.split()[0] == axis)
                for axis in AXES
                if axes.get(axis, 1) > 1
            ]
        )
        fig.add_trace(
            go.Scatter(
                x=[place.get("cp", 0) * T + place["tp"]],
                y=[place["pp"]],
                mode="markers+text",
                text=[f"<b>rank {r}</b><br>{place['holds']}"],
                textposition="middle center",
                marker={"symbol": "square", "size": 120, "color": rank_color(r), "opacity": 0.35},
                hovertext=[hover],
                hoverinfo="text",
                showlegend=False,
            ),
            row=1,
            col=place["dp"] + 1,
        )
    ticks = [f"cp {c}, tp {t}" if C > 1 else f"tp {t}" for c in range(C) for t in range(T)]
    fig.update_xaxes(range=[-0.6, C * T - 0.4], tickvals=list(range(C * T)), ticktext=ticks)
    fig.update_yaxes(range=[S - 0.4, -0.6], tickvals=list(range(S)), title_text="pp (pipeline stage)", col=1)
    fig.update_yaxes(range=[S - 0.4, -0.6], tickvals=list(range(S)))
    shape = " x ".join(f"{a} {axes.get(a, 1)}" for a in AXES)
    title = f"Device mesh {shape} = {D * S * C * T} ranks: who holds what"
    return style(fig, title, height=220 + 190 * S)


BUILDER_SIZES = (1, 2, 4)


def build_and_run(dp=1, pp=2, cp=1, tp=2, zero=0, sequence_parallel=True, cp_method="ring", schedule="1f1b"):
    """Run the chosen mesh (at most 8 ranks, one step of the reference GPT) and draw who holds what; a
    combination that cannot run prints the reason `check_parallel_dims` gives, before any process starts."""
    from parlab.runs.hybrid import HybridOptions, run_hybrid

    chosen = dict(
        dp=dp,
        pp=pp,
        cp=cp,
        tp=tp,
        zero=zero,
        sequence_parallel=sequence_parallel,
        cp_method=cp_method,
        schedule=schedule,
        steps=1,
    )
    try:
        opts = HybridOptions.make(**chosen)
        opts.validate()
        if opts.world_size > 8:
            raise ValueError(f"{opts.world_size} ranks: keep dp x pp x cp x tp <= 8 here")
    except ValueError as exc:
        print(f"cannot run: {exc}")
        return None
    _, report = run_hybrid(**chosen)
    failed = [line for line in report["verdicts"] if not line.endswith("PASS")]
    print(
        f"{report['world_size']} ranks: one step {'equal to one device' if report['passed'] else 'DIFFERS'}"
        f" (max |err| {report['max_abs_err']:.0e}); every axis' bytes as theory: {not failed}"
    )
    for key, theory in report["comm"]["per_axis_theory"].items():
        print(f"  {key:20s} payload per rank {theory}")
    mesh_figure(report).show()
    return report


def mesh_builder():
    """Widgets for each axis' size and the options; each change runs the mesh live (parlab.views.widgets.interact)."""
    from ipywidgets import Checkbox, Dropdown

    from parlab.schemes.hybrid.stage import CP_METHODS
    from parlab.schemes.pipeline.schedules import SCHEDULES
    from parlab.views.widgets import interact

    sizes = {
        axis: Dropdown(options=BUILDER_SIZES, value=v, description=axis)
        for axis, v in (("dp", 1), ("pp", 2), ("cp", 1), ("tp", 2))
    }
    return interact(
        build_and_run,
        **sizes,
        zero=Dropdown(options=[0, 1, 2, 3], value=0, description="ZeRO"),
        sequence_parallel=Checkbox(value=True, description="SP on tp"),
        cp_method=Dropdown(options=list(CP_METHODS), value="ring", description="cp"),
        schedule=Dropdown(options=list(SCHEDULES), value="1f1b", description="schedule"),
    )


def axis_traffic_figure(report: dict):
    """Payload bytes each rank handed to its calls on each axis during the run (measured from the trace: each
    call's mesh axis), one panel per axis and kind of call, bars, with the theory as black markers."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from parlab.views.plots import kind_color, style

    measured, theory = report["comm"]["per_axis_measured"], report["comm"]["per_axis_theory"]
    what = {
        "dp": "gradients over the replicas",
        "pp": "activations and gradients",
        "tp": "inside each layer",
        "cp": "attention over the sequence",
        "dp_cp": "gradients over dp x cp",
    }
    keys = list(measured)  # "dp all_reduce", "pp send", "tp all_reduce", ...
    titles = [f"{key.split()[0]}: {key.split()[1].replace('_', '-')} ({what[key.split()[0]]})" for key in keys]
    fig = make_subplots(rows=len(keys), cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.08)
    ranks = [f"rank {r}" for r in range(report["world_size"])]
    for row, key in enumerate(keys, start=1):
        hover = "%{x}: %{y} payload bytes measured<extra></extra>"
        fig.add_trace(
            go.Bar(
                name=f"{key} measured",
                x=ranks,
                y=measured[key],
                marker_color=kind_color(key.split()[1]),
                hovertemplate=hover,
            ),
            row=row,
            col=1,
        )
        marker = {"color": "black", "symbol": "line-ew-open", "size": 28, "line": {"width": 3}}
        fig.add_trace(
            go.Scatter(
                name="theory",
                showlegend=row == 1,
                x=ranks,
                y=theory[key],
                mode="markers",
                marker=marker,
                hovertemplate="%{x}: %{y} payload bytes in theory<extra></extra>",
            ),
            row=row,
            col=1,
        )
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
