"""Play a recorded run back: `replay(results.trace)` is the run's timeline with play / pause / speed buttons and a
step slider, and under it the state of the ranks at the moment shown.

    from parlab.views.replay import replay
    results, report = run_pipeline("1f1b", 4, microbatches=8)
    replay(results.trace)                     # or replay(trace, kind="pipeline", frames=60)

Each frame t draws every event as far as it had got at t (an event not yet started is not drawn, one in progress
is cut at t), a red line at t, and in words, per rank, what the trace says held at t:

    pipeline   micro-batches in flight (forwards done, backwards not yet), what the rank is doing
    dp         buckets all-reduced / in flight, payload bytes so far
    zero       all-gathers (parameters) and reduce-scatters (gradients) done / in flight, and the last unit gathered
    offload    bytes copied so far, per direction (device -> host, host -> device, disk)
    ring       whose K/V block the rank holds (followed through its recvs), score tiles done
    ps         the server's updates and their staleness; per worker the gradients pushed and parameters pulled
    generic    what the rank is doing and its payload bytes so far (any other trace)

Everything is plotly animation frames: it plays in JupyterLab, in a saved notebook and in an exported HTML file,
with no kernel. The frames are data (`fig.frames[k].layout.annotations[0].text`), which the tests read.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import plotly.graph_objects as go

from parlab.core.trace import Event, Trace
from parlab.views import plots

KINDS = ("pipeline", "dp", "zero", "offload", "ring", "ps", "generic")
COPY_KINDS = ("offload", "upload", "disk_read", "disk_write")
SPEEDS = {"½×": 0.5, "1×": 1.0, "2×": 2.0, "4×": 4.0}
FRAME_MS = 250  # one frame at 1× speed
# Under the plot: the buttons' row, the slider's row below it (its value label at the right end, clear of the
# buttons), then the state at that moment.
CONTROLS_PX = 175
MAX_HEIGHT = 640  # the figure and its controls on one 1280x720 slide, with the line of code that drew it


def detect(trace: Trace) -> str:
    """Which kind of timeline a trace is, from what its events carry (see the module docstring)."""
    events = trace.events
    if any("attn" in e.extra for e in events):
        return "ring"
    if any("mb" in e.extra for e in events):
        return "pipeline"
    if any(e.kind in COPY_KINDS for e in events):
        return "offload"
    if any(e.label.startswith(("push grad", "grad from")) for e in events):
        return "ps"
    if any(e.kind in ("all_gather", "reduce_scatter") and not e.label.startswith("check") for e in events):
        return "zero"
    if any(e.label.startswith("bucket") for e in events):
        return "dp"
    return "generic"


def _end(e: Event) -> float:
    return e.start + e.duration


def _done(events: list[Event], t: float) -> list[Event]:
    return [e for e in events if _end(e) <= t]


def _running(events: list[Event], t: float) -> list[Event]:
    return [e for e in events if e.start <= t < _end(e)]


def _doing(trace: Trace, rank: int, t: float) -> str:
    now = _running(trace.select(rank=rank), t)
    said = [
        e.label if e.label.startswith(plots.kind_label(e.kind)) else f"{plots.kind_label(e.kind)} {e.label}"
        for e in now
    ]
    return ", ".join(s.strip() for s in said[-2:]) or "idle"


def _comm_bytes(trace: Trace, rank: int, t: float) -> int:
    return sum(e.bytes for e in _done(trace.select(rank=rank, compute=False), t))


def state_at(trace: Trace, t: float, kind: str | None = None) -> list[str]:
    """What the trace says each rank holds and does at time t (seconds after trace.t0), one line per rank."""
    kind = kind or detect(trace)
    if kind not in KINDS:
        raise ValueError(f"unknown replay kind {kind!r}; available: {', '.join(KINDS)}")
    t += trace.t0
    lines = []
    for r in range(trace.world_size):
        mine = trace.select(rank=r)
        if kind == "pipeline":
            fwd = {(e.extra["mb"], e.extra.get("chunk", 0)) for e in _done(mine, t) if e.kind == "forward"}
            bwd = {(e.extra["mb"], e.extra.get("chunk", 0)) for e in _done(mine, t) if e.kind.startswith("backward")}
            text = f"{len(fwd - bwd)} micro-batches in flight {sorted(m for m, _ in fwd - bwd)}"
        elif kind == "dp":
            buckets = [e for e in mine if e.label.startswith("bucket")]
            text = f"buckets all-reduced {len(_done(buckets, t))}, in flight {len(_running(buckets, t))}"
        elif kind == "zero":
            gathers = [e for e in mine if e.kind == "all_gather" and not e.label.startswith("check")]
            scatters = [e for e in mine if e.kind == "reduce_scatter"]
            last = _done(gathers, t)[-1].label if _done(gathers, t) else "none yet"
            text = (
                f"all-gathers {len(_done(gathers, t))} (+{len(_running(gathers, t))} in flight), "
                f"reduce-scatters {len(_done(scatters, t))}; last gathered: {last}"
            )
        elif kind == "offload":
            copies = [e for e in _done(mine, t) if e.kind in COPY_KINDS]
            per = {k: sum(e.bytes for e in copies if e.kind == k) for k in COPY_KINDS}
            text = ", ".join(f"{plots.kind_label(k)} {v / 1e3:.1f} KB" for k, v in per.items() if v) or "no copies"
        elif kind == "ring":
            text = _ring_state(trace, r, t)
        elif kind == "ps":
            text = _ps_state(trace, r, t)
        else:
            text = ""
        bytes_so_far = f"{_comm_bytes(trace, r, t):,} payload bytes so far"
        lines.append(f"rank {r}: " + "; ".join(x for x in (text, bytes_so_far, "now: " + _doing(trace, r, t)) if x))
    return lines


def _ring_state(trace: Trace, rank: int, t: float) -> str:
    """Whose K/V block `rank` holds at t: its k-th K/V recv brought what the sender held after k-1 recvs."""
    phases = [p for p in ("fwd", "bwd") if trace.select(rank=rank) and _kv_recvs(trace, rank, p)]
    tiles = [e for e in _done(trace.select(rank=rank, compute=True), t) if "attn" in e.extra]
    phase = "bwd" if any(e.extra["attn"] == "bwd" for e in tiles) and "bwd" in phases else "fwd"
    got = len(_done(_kv_recvs(trace, rank, phase), t))
    origin = _origin(trace, rank, got, phase)
    return f"holds K/V of rank {origin} ({phase}), {len(tiles)} score tiles done"


def _kv_recvs(trace: Trace, rank: int, phase: str) -> list[Event]:
    return [e for e in trace.select(kind="recv", rank=rank) if e.label.startswith(f"kv {phase}")]


def _origin(trace: Trace, rank: int, received: int, phase: str) -> int:
    @cache
    def origin(r: int, k: int) -> int:
        recvs = _kv_recvs(trace, r, phase)
        if k == 0 or k > len(recvs) or recvs[k - 1].peer is None:
            return r
        return origin(recvs[k - 1].peer, k - 1)

    return origin(rank, received)


def _ps_state(trace: Trace, rank: int, t: float) -> str:
    mine = _done(trace.select(rank=rank), t)
    updates = [e for e in mine if e.kind == "optimizer"]
    if any(e.label.startswith(("params", "grad from")) for e in trace.select(rank=rank)):  # the server
        stale = [e.extra["staleness"] for e in updates if "staleness" in e.extra]
        return f"server: {len(updates)} updates" + (f", last staleness {stale[-1]}" if stale else "")
    pushes = [e for e in mine if e.kind == "send" and e.label.startswith("push")]
    pulls = [e for e in mine if e.kind == "recv" and e.label.startswith("pull")]
    return f"worker: {len(pushes)} gradients pushed, {len(pulls)} parameter pulls"


def replay(
    trace: Trace | str | Path,
    kind: str | None = None,
    frames: int = 40,
    title: str | None = None,
    unit: str = "ms",
) -> go.Figure:
    """The trace's timeline as an animation: play / pause / speed buttons, a step slider, the state under it.
    `trace`: a Trace, or the path of one saved with `Trace.save` (a run recorded elsewhere)."""
    if isinstance(trace, (str, Path)):
        trace = Trace.load(trace)
    kind = kind or detect(trace)
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    fig = plots.timeline(trace, title=title or f"Replay ({kind}): {len(trace)} events on {trace.world_size} ranks")
    groups = [[e for e in trace.events if e.kind == k] for k in dict.fromkeys(e.kind for e in trace.events)]
    span = trace.span_seconds()
    times = [span * k / max(frames - 1, 1) for k in range(frames)]
    names = [f"{t * scale:.1f}" for t in times]
    fig.frames = [
        go.Frame(name=name, data=_frame_bars(groups, trace.t0 + t, scale), layout=_frame_layout(trace, t, kind, scale))
        for name, t in zip(names, times, strict=True)
    ]
    first = fig.frames[-1]  # the figure opens on the whole run; play starts from the beginning
    fig.update_layout(shapes=first.layout.shapes, annotations=first.layout.annotations)
    fig.update_xaxes(range=[0, span * scale * 1.02])
    lines = trace.world_size + 1
    fig.update_layout(
        height=min((fig.layout.height or 400) + CONTROLS_PX + 22 * lines, MAX_HEIGHT),  # the bars give way
        margin={"b": CONTROLS_PX + 20 + 22 * lines},
        updatemenus=[_buttons()],
        sliders=[_slider(names, unit)],
    )
    return fig


def _frame_bars(groups: list[list[Event]], t: float, scale: float) -> list[go.Bar]:
    """Each kind's bars as far as they had got at t: not started -> no width, running -> cut at t."""
    bars = []
    for events in groups:
        widths = [max(0.0, min(_end(e), t) - e.start) * scale if e.start <= t else 0.0 for e in events]
        bars.append(go.Bar(x=widths, text=[e.label if e.start <= t else "" for e in events]))
    return bars


def _frame_layout(trace: Trace, t: float, kind: str, scale: float) -> dict:
    now = {
        "type": "line",
        "x0": t * scale,
        "x1": t * scale,
        "y0": 0,
        "y1": 1,
        "yref": "paper",
        "line": {"color": "#D62728", "width": 3},
    }
    text = f"<b>at {t * scale:.1f} {'ms' if scale == 1e3 else 's' if scale == 1 else 'us'}</b><br>" + "<br>".join(
        state_at(trace, t, kind)
    )
    state = {
        "x": 0,
        "y": 0,
        "xref": "paper",
        "yref": "paper",
        "xanchor": "left",
        "yanchor": "top",
        "yshift": -CONTROLS_PX,
        "align": "left",
        "showarrow": False,
        "text": text,
        "font": {"size": plots.FONT_SIZE - 3},
    }
    return {"shapes": [now], "annotations": [state]}


def _animate(frames, duration: int) -> dict:
    return {
        "args": [
            frames,
            {
                "frame": {"duration": duration, "redraw": True},
                "mode": "immediate",
                "fromcurrent": True,
                "transition": {"duration": 0},
            },
        ],
        "method": "animate",
    }


def _buttons() -> dict:
    speeds = [{**_animate(None, int(FRAME_MS / s)), "label": f"▶ {name}"} for name, s in SPEEDS.items()]
    pause = {**_animate([None], 0), "label": "❚❚ pause"}
    return {
        "type": "buttons",
        "direction": "left",
        "buttons": [*speeds, pause],
        "x": 0,
        "y": 0,
        "xanchor": "left",
        "yanchor": "top",
        "pad": {"t": 50},
        "showactive": False,
    }


def _slider(names: list[str], unit: str) -> dict:
    steps = [{**_animate([name], 0), "label": name} for name in names]
    return {
        "steps": steps,
        "active": len(names) - 1,
        "x": 0,
        "len": 1.0,
        "y": 0,
        "yanchor": "top",
        "pad": {"t": 100},
        "font": {"color": "rgba(0,0,0,0)"},  # one label per frame would crowd into unreadable ticks: only the value
        "currentvalue": {"prefix": "at ", "suffix": f" {unit}", "xanchor": "right", "font": {"color": "#222"}},
    }
