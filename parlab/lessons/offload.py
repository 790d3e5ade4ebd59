"""Lesson 06 (notebooks/06_offload.ipynb): where the training state lives, and what moving it costs.

The scheme (ZeRO-2 with Adam's state on the device, the host or the disk) is in parlab/schemes/zero/offload.py, and
`parlab.runs.offload.run_offload` runs and checks it; this module draws what a run did:

    memory where it lives     `step_memory` / `draw_memory_by_place`: device, host and disk bytes at each moment of
                              one step, counted from the ranks' tensors and files, stacked
    the time of each copy     `copy_seconds` / `draw_copy_seconds`: seconds per step of each kind of copy, measured
    one step on a timeline    `draw_step`: compute above, collectives and copies below
    the calculator            `draw_budget`: the formulas at any model size, against a device budget
"""

from __future__ import annotations

from parlab.core.trace import Trace
from parlab.schemes.zero.offload import PLACES
from parlab.schemes.zero.theory import offload_memory

PLACE_COLORS = {"device": "#4C78A8", "host": "#F58518", "disk": "#54A24B"}
COPY_KINDS = ("offload", "upload", "disk_read", "disk_write")
MOMENTS = (
    "after forward",
    "during backward",
    "before the optimizer step",
    "during the optimizer step",
    "after the step",
)


def _moment(label: str) -> str:
    if label == "bucket flattened":
        return "during backward"
    if label.startswith("state of"):
        return "during the optimizer step"
    return label


def _total(parts: dict[str, dict[str, int]]) -> int:
    return sum(sum(what.values()) for what in parts.values())


def step_memory(ledger: list[dict], step: int) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes by place at each moment of one step, from a rank's ledger (train_offload's "ledger"): for moments
    recorded several times (each bucket during backward, each unit's state read), the largest.
    Returns {moment: {place: {what: bytes}}}."""
    out = {}
    for row in ledger:
        if row.get("step") != step:
            continue
        moment = _moment(row["label"])
        parts = {p: {k.split(":", 1)[1]: v for k, v in row.items() if k.startswith(p + ":") and v} for p in PLACES}
        if moment not in out or _total(parts) > _total(out[moment]):
            out[moment] = parts
    return {m: out[m] for m in MOMENTS if m in out}


def draw_memory_by_place(ledgers: dict[str, list[dict]], step: int = 1, unit: float = 1e3):
    """Plotly: for each target, stacked bars of the bytes on the device, the host and the disk at each moment of
    one step (rank 0, measured). ledgers: {target: rank 0's ledger}. unit: bytes per axis unit (1e3: KB)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from parlab.views import plots

    targets = list(ledgers)
    fig = make_subplots(rows=1, cols=len(targets), shared_yaxes=True, subplot_titles=[f"target {t}" for t in targets])
    for col, target in enumerate(targets, start=1):
        table = step_memory(ledgers[target], step)
        moments = list(table)
        for place in PLACES:
            values = [sum(table[m][place].values()) / unit for m in moments]
            hover = [", ".join(f"{k} {v:,}" for k, v in table[m][place].items()) or "nothing" for m in moments]
            fig.add_trace(
                go.Bar(
                    x=moments,
                    y=values,
                    name=place,
                    marker_color=PLACE_COLORS[place],
                    showlegend=col == 1,
                    legendgroup=place,
                    customdata=hover,
                    hovertemplate=f"{place}: %{{y:.1f}} KB<br>%{{customdata}} bytes<extra>{target}</extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_layout(barmode="stack")
    fig.update_xaxes(tickangle=-30)
    title = f"Where the training state lives during step {step + 1}, rank 0 (bytes counted from its tensors and files)"
    return plots.style(fig, title, None, "KB per rank", height=520)


def copy_seconds(trace: Trace, rank: int = 0) -> dict[str, float]:
    """Seconds per step that one rank spent in each kind of copy and in the optimizer step (measured; a copy runs
    in the copy engine's thread, beside the compute)."""
    steps = {e.extra.get("step") for e in trace.select(rank=rank) if "step" in e.extra}
    out = {}
    for kind in (*COPY_KINDS, "optimizer", "backward"):
        events = trace.select(kind=kind, rank=rank)
        if events:
            out[kind] = sum(e.duration for e in events) / max(len(steps), 1)
    return out


def overlaps(trace: Trace, rank: int = 0) -> dict[str, tuple[int, int]]:
    """Counted from the trace (one rank), each as (overlapping, all):
    gradient copies to the host that started while a backward span was still running; and state reads of unit
    k in flight while unit k-1 was stepped (read ahead: the read overlaps the Adam span of the unit before)."""
    mine = trace.select(rank=rank)
    backward = [e for e in mine if e.kind == "backward"]
    offloads = [e for e in mine if e.kind == "offload"]
    during = sum(any(b.start <= e.start < b.end for b in backward) for e in offloads)
    adam = [e for e in mine if e.kind == "optimizer"]  # labels "Adam <unit>"
    reads = [e for e in mine if e.kind == "disk_read"]  # labels "state <unit>", in unit order within a step
    ahead = 0
    for previous, read in zip(reads, reads[1:], strict=False):
        if previous.extra["step"] != read.extra["step"]:
            continue  # the first unit of a step: nothing to be ahead of
        label = "Adam " + previous.label.removeprefix("state ")  # the Adam span of the unit before
        before = min((a for a in adam if a.label == label), key=lambda a: abs(a.start - read.start))
        ahead += read.start < before.end and before.start < read.end  # in flight while the unit before is stepped
    return {
        "gradient copies started during backward": (during, len(offloads)),
        "state reads in flight during the previous unit's Adam": (ahead, len(reads)),
    }


def draw_copy_seconds(traces: dict[str, Trace], rank: int = 0):
    """Plotly: grouped bars, for each target, of the milliseconds per step each kind of copy took (measured)."""
    import plotly.graph_objects as go

    from parlab.views import plots

    fig = go.Figure()
    kinds = [*COPY_KINDS, "optimizer", "backward"]
    for kind in kinds:
        ms = [copy_seconds(trace, rank).get(kind, 0.0) * 1e3 for trace in traces.values()]
        hover = f"{plots.kind_label(kind)}: %{{y:.2f}} ms per step<extra>%{{x}}</extra>"
        fig.add_trace(
            go.Bar(
                x=list(traces),
                y=ms,
                name=plots.kind_label(kind),
                marker_color=plots.kind_color(kind),
                hovertemplate=hover,
            )
        )
    fig.update_layout(barmode="group")
    return plots.style(fig, f"Time per step in each copy, rank {rank} (measured)", "target", "ms per step")


def draw_step(trace: Trace, step: int, title: str):
    """Plotly timeline of one step (parlab.views.plots.timeline): forward, backward and the Adam spans above; the
    collectives and the copy engine's copies (offload, upload, disk read, disk write) below."""
    from parlab.views import plots

    return plots.timeline(trace.of_step(step), title)


def draw_budget(psi: float, N: int, b_c: int, b_m: int, device_budget_gb: float):
    """Plotly: the formulas' bytes per rank by place for each target (steady state, model states only), for Psi
    parameters on N ranks, beside a device budget (dashed line)."""
    import plotly.graph_objects as go

    from parlab.views import plots

    fig = go.Figure()
    tables = {t: offload_memory([int(psi)], N, t, b_c, b_m)["steady_total"] for t in ("none", "cpu", "disk")}
    for place in PLACES:
        fig.add_trace(
            go.Bar(
                x=list(tables),
                y=[tables[t][place] / 1e9 for t in tables],
                name=place,
                marker_color=PLACE_COLORS[place],
                hovertemplate=f"{place}: %{{y:.2f}} GB per rank<extra>%{{x}}</extra>",
            )
        )
    fig.add_hline(y=device_budget_gb, line_dash="dash", annotation_text=f"device budget {device_budget_gb:g} GB")
    fig.update_layout(barmode="group")
    title = f"Psi = {psi / 1e9:g} B parameters on N = {N}: bytes per rank by place (formulas)"
    return plots.style(fig, title, "target", "GB per rank")
