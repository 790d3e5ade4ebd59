"""Lesson 03 (notebooks/03_pipeline_parallel.ipynb): the figures and tables around the scheme.

The scheme itself is in parlab/schemes/pipeline/schedules.py (the schedules as data, their exact ideal timelines and
bubbles) and parlab/schemes/pipeline/executor.py (the stages and the executor that runs a schedule on real ranks); this
module only draws and prints what they computed, in the lesson's order:

    a run's checks           `print_report`: the report of `run_pipeline`, deterministic lines or measured ones
    one schedule             `timelines`: its ideal timeline (unit costs) above the measured one of a real run
    the schedules compared   `bubble_table`: ideal bubble, formula and activations held, for all six at once
    the V shapes             `v_formula_lines`: ZB-V's and DualPipeV's idle time beside their papers' formulas

Parent-side only (nothing here runs on a rank), so plotly is imported at the top.
"""

from __future__ import annotations

from fractions import Fraction

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from parlab.core.trace import Trace
from parlab.schemes.pipeline import schedules_v
from parlab.schemes.pipeline.actions import DEFAULT_COSTS, SPAN_KIND, Schedule
from parlab.schemes.pipeline.executor import measured_bubble
from parlab.schemes.pipeline.schedules import (
    SCHEDULES,
    V_SCHEDULES,
    bubble,
    bubble_formula,
    make_schedule,
    peak_inflight,
    simulate,
)
from parlab.views import plots

NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved": "interleaved 1F1B",
    "zb": "zero bubble (ZB-H1)",
    "zbv": "ZB-V (V-shaped zero bubble)",
    "dualpipev": "DualPipeV",
}
CHUNK_PATTERNS = ["", "/", "x", ".", "\\", "+"]  # chunk 0 plain, chunk 1 hatched, ...: same colours throughout


# ------------------------------------------------------------------------------------------------- printing


def print_report(report: dict, measured: bool = False) -> None:
    """Print a run's report: the deterministic lines (checks, ideal bubble, phases, memory held), or with
    measured=True the timing-dependent ones (measured bubble per rank), which vary from run to run."""
    if measured:
        per_rank = ", ".join(f"{b:.0%}" for b in report["bubble_measured_per_rank"])
        print(f"bubble measured: {report['bubble_measured']:.1%} (per rank: {per_rank})")
        print(f"bubble ideal:    {report['bubble_ideal']:.1%} = {report['bubble_ideal_fraction']}")
        return
    for line in report["verdicts"]:
        if not line.startswith("bubble measured"):
            print(line)
    kib = ", ".join(f"{b / 1024:.0f}" for b in report["peak_activation_bytes_per_rank"])
    print(f"peak activation memory held per rank (KiB, measured from the saved tensors): {kib}")


def bubble_table(p: int, m: int, v: int = 2) -> list[str]:
    """The six schedules side by side, from their ideal timelines (pure Python, instant): bubble (exact), its
    formula, and the most activations a rank holds (in (micro-batch, chunk) units and in whole-stage units)."""
    lines = [
        f"p={p}, m={m}, v={v} (interleaved)",
        f"{'schedule':12s} {'ideal bubble':>20s} {'formula':>10s}  peak held",
    ]
    for name in SCHEDULES:
        vv = chunks(name, v)
        try:
            schedule = make_schedule(name, p, m, vv)
        except ValueError as exc:
            lines.append(f"{name:12s} {exc}")
            continue
        ideal = bubble(simulate(schedule), p)
        formula, _ = bubble_formula(name, p, m, vv)
        if name in V_SCHEDULES and not schedules_v.formula_holds(name, p, m):
            formula = "-"  # the closed form needs the V filled (schedules_v.formula_holds)
        peak = max(peak_inflight(schedule))
        held = f"{peak} (= {Fraction(peak, vv)} stages of activations)" if vv > 1 else f"{peak}"
        lines.append(f"{name:12s} {str(ideal) + f' = {float(ideal):.3f}':>20s} {str(formula):>10s}  {held}")
    return lines


def chunks(name: str, v: int = 2) -> int:
    """Model chunks per rank of schedule `name`: v for interleaved, 2 for the V shapes, else 1."""
    return v if name == "interleaved" else 2 if name in V_SCHEDULES else 1


def v_formula_lines(p: int, m: int) -> list[str]:
    """ZB-V and DualPipeV beside their papers' formulas (parlab/schemes/pipeline/schedules_v.py): per rank, the idle
    time of the exact ideal timeline and the one each paper's formula gives (cost units, F = BI = BW = 1, B = 2)."""
    lines = [f"p={p}, m={m}: idle time per rank (units of F)", f"{'schedule':10s} {'exact':>6s}  paper's formula"]
    for name in V_SCHEDULES:
        try:
            schedule = make_schedule(name, p, m, 2)
        except ValueError as exc:
            lines.append(f"{name:10s} {exc}")
            continue
        timeline = simulate(schedule)
        makespan = max(t.end for t in timeline)
        idle = sum(makespan - sum(t.end - t.start for t in timeline if t.rank == r) for r in range(p)) / p
        paper, text = schedules_v.paper_idle(name, p)
        lines.append(f"{name:10s} {str(idle):>6s}  {text} = {paper}")
    return lines


# ------------------------------------------------------------------------------------------------ timelines


def ideal_rows(schedule: Schedule, costs: dict | None = None) -> list[dict]:
    """The ideal timeline (simulate) as bars: one per action, in cost units."""
    return [
        {
            "rank": t.rank,
            "kind": SPAN_KIND[t.action.op],
            "start": float(t.start),
            "length": float(t.end - t.start),
            "text": str(t.action.mb),  # the micro-batch; colour says F/B, hatching the chunk (as in the papers)
            "chunk": t.action.chunk,
            "hover": f"rank {t.rank} · {t.action.label(schedule.v)} (micro-batch {t.action.mb}, chunk "
            f"{t.action.chunk}, stage {schedule.stage(t.rank, t.action.chunk)})<br>start {t.start}, end {t.end}",
        }
        for t in simulate(schedule, costs)
    ]


def measured_rows(trace: Trace, step: int | None = None) -> list[dict]:
    """One step's recorded spans (F, B, BI, BW) and receive waits as bars, in ms since the step's first span."""
    step = trace.last_step() if step is None else step
    spans = [e for e in trace.of_step(step).events if e.kind in SPAN_KIND.values()]
    t0, t1 = min(e.start for e in spans), max(e.end for e in spans)
    waits = [e for e in trace.select(kind="recv") if e.end is not None and t0 <= e.start and e.end <= t1]
    return [
        {
            "rank": e.rank,
            "kind": e.kind,
            "start": (e.start - t0) * 1e3,
            "length": max(e.duration * 1e3, 1e-3),
            "text": "" if e.kind == "recv" else str(e.extra.get("mb", "")),
            "chunk": e.extra.get("chunk", 0),
            "hover": f"rank {e.rank} · {e.kind} {e.label}<br>start {(e.start - t0) * 1e3:.3f} ms<br>"
            f"duration {e.duration * 1e3:.3f} ms" + (f"<br>{e.bytes} bytes from rank {e.peer}" if e.bytes else ""),
        }
        for e in sorted(waits + spans, key=lambda e: e.start)
    ]


def _bars(fig: go.Figure, rows: list[dict], row: int, legend: set[str]) -> None:
    """Add one horizontal bar per dict (rank, kind, start, length, text, chunk, hover) to subplot `row`."""
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        fig.add_trace(
            go.Bar(
                name="recv (waiting for data)" if kind == "recv" else kind,
                legendgroup=kind,
                width=0.25 if kind == "recv" else None,  # waits drawn thin: the compute stands out
                showlegend=kind not in legend,
                orientation="h",
                y=[f"rank {r['rank']}" for r in mine],
                base=[r["start"] for r in mine],
                x=[r["length"] for r in mine],
                text=[r["text"] for r in mine],
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,
                marker={
                    "color": plots.kind_color(kind),
                    "line": {"color": "white", "width": 1},
                    "pattern": {"shape": [CHUNK_PATTERNS[r["chunk"] % len(CHUNK_PATTERNS)] for r in mine]},
                },
                hovertemplate=[r["hover"] + "<extra></extra>" for r in mine],
            ),
            row=row,
            col=1,
        )
        legend.add(kind)


def timelines(
    schedule: Schedule,
    trace: Trace | None = None,
    costs: dict | None = None,
    title: str | None = None,
    step: int | None = None,
) -> go.Figure:
    """The ideal timeline of `schedule` (unit costs), and below it, if a trace is given, the measured one.

    Bars: blue forward, orange backward (BI orange, BW red for zero bubble), dark teal the time a rank waits in a
    recv (drawn thin); the number on a bar is its micro-batch; hatched bars are a rank's chunks 1..v-1.
    Hover shows the exact action ("F3c1": forward of micro-batch 3 on chunk 1), start and end.
    """
    costs_used = {**DEFAULT_COSTS, **(costs or {})}
    ideal = bubble(simulate(schedule, costs), schedule.p)
    ops = [op for op in SPAN_KIND if any(a.op == op for a in schedule.actions[0])]
    cost_text = ", ".join(f"{op}={costs_used[op]}" for op in ops)
    titles = [f"ideal ({cost_text}): bubble {ideal} = {float(ideal):.1%}"]
    if trace is not None:
        measured, _ = measured_bubble(trace, step)
        titles.append(f"measured on {schedule.p} ranks (one step): bubble {measured:.1%}")
    fig = make_subplots(rows=len(titles), cols=1, subplot_titles=titles, vertical_spacing=0.16)
    legend: set[str] = set()
    _bars(fig, ideal_rows(schedule, costs), 1, legend)
    fig.update_xaxes(title_text="time (cost units: one forward = 1)", row=1, col=1)
    for k in range(1, schedule.v):  # a legend entry for the hatching of chunks 1..v-1
        pattern = {"shape": CHUNK_PATTERNS[k % len(CHUNK_PATTERNS)], "fgcolor": "#444"}
        fig.add_trace(
            go.Bar(x=[None], y=[None], name=f"hatched: chunk {k}", marker={"color": "white", "pattern": pattern})
        )
    if trace is not None:
        _bars(fig, measured_rows(trace, step), 2, legend)
        fig.update_xaxes(title_text="time since the step's first span (ms)", row=2, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=[f"rank {r}" for r in reversed(range(schedule.p))])
    fig.update_layout(barmode="overlay", bargap=0.2, uniformtext={"minsize": 10, "mode": "hide"})
    if title is None:
        title = f"{NAMES[schedule.name]}: p={schedule.p}, m={schedule.m}" + (
            f", v={schedule.v}" if schedule.v > 1 else ""
        )
    height = len(titles) * (110 + 45 * schedule.p) + 80
    return plots.style(fig, title, height=height)
