"""Every figure parlab draws, and the one palette they share.

The same rank has the same colour in every lesson (RANK_COLORS), and so does each kind of action in every
timeline (KIND_COLORS): forward blue, backward orange, communication green-grey, idle light grey.
`style(fig, ...)` applies the package's figure defaults: a title, axis titles with units, fonts readable at
presentation size.

Imports plotly, so rank code never imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from parlab.core.trace import Trace

# One colour per rank (up to 8; ranks beyond wrap around). Colour-blind-friendly (Okabe-Ito order).
RANK_COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]

KIND_COLORS = {
    # compute
    "forward": "#4C78A8",
    "backward": "#F58518",
    "backward_input": "#F58518",
    "backward_weight": "#E45756",
    "optimizer": "#B279A2",
    "compute": "#72B7B2",
    # communication
    "all_reduce": "#54A24B",
    "reduce_scatter": "#88D27A",
    "all_gather": "#2E7D32",
    "all_to_all": "#9D755D",
    "broadcast": "#BAB0AC",
    "reduce": "#8CD17D",
    "send": "#17BECF",  # light cyan against recv's dark teal: a luminance contrast of 3.7:1 (WCAG's 3:1 for graphics),
    "recv": "#0B5563",  # so the pair reads apart on a projector and in grey
    "barrier": "#666666",
    # copies between device, host and disk (offload)
    "offload": "#E45756",
    "upload": "#72B7B2",
    "disk_read": "#9D755D",
    "disk_write": "#BAB0AC",
    # nothing
    "idle": "#E5E5E5",
}
# Legend names: what a student reads, for the kinds parlab.core.comm and comm.span record.
KIND_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "backward_input": "backward (input grads)",
    "backward_weight": "backward (weight grads)",
    "optimizer": "optimizer step",
    "compute": "compute",
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
    "all_to_all": "all-to-all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "send": "send",
    "recv": "recv",
    "barrier": "barrier",
    "idle": "idle",
}
# Curves that compare implementations: the reference, parlab's parallel run, another library's run.
SERIES_COLORS = {"single device": "#000000", "parlab": "#7B3294", "other library": "#1B9E77"}
REDUCED_COLOR = "#7F7F7F"  # a chunk that is a sum over several ranks
EMPTY_COLOR = "#FFFFFF"

FONT_SIZE = 16
# The tallest figure `style` draws: a slide at 1280x720 holds the figure and the line of code that drew it (a figure
# with many rows of subplots gets shorter rows instead of running off the projector's screen).
MAX_HEIGHT = 560
TITLE_SIZE = 20
BAR_LINE = 0.5  # the white outline between timeline bars

# ---------------------------------------------------------------------------------------------------- themes
# A theme changes sizes and contrast, never colours: the palette above stays the same (colour-blind-safe) in both.
#   default    what the lessons show on a laptop screen
#   projector  read from the back of a room: larger fonts, thicker lines and bar outlines, black text and axes,
#              long titles broken over lines (so a title never runs into another)
THEMES = {
    "default": {"font": 16, "title": 20, "bar_line": 0.5, "line": 2, "marker": 6, "ink": "#2a3f5f", "grid": None},
    "projector": {
        "font": 22,
        "title": 26,
        "bar_line": 1.5,
        "line": 4,
        "marker": 11,
        "ink": "#000000",
        "grid": "#BBBBBB",
    },
}
_theme = "default"


def theme() -> str:
    """The name of the theme in use ("default" or "projector")."""
    return _theme


def use_theme(name: str = "default") -> None:
    """Switch every figure drawn from now on to a theme: `plots.use_theme("projector")` before presenting,
    `plots.use_theme("default")` to go back. Figures already drawn keep their look (draw them again).

    It also becomes plotly's default template, so a figure a lesson builds without `style` follows it too.
    """
    import plotly.io as pio

    global _theme, FONT_SIZE, TITLE_SIZE, BAR_LINE
    if name not in THEMES:
        raise ValueError(f"unknown theme {name!r}; available: {', '.join(THEMES)}")
    t = THEMES[name]
    _theme, FONT_SIZE, TITLE_SIZE, BAR_LINE = name, t["font"], t["title"], t["bar_line"]
    pio.templates.default = "plotly" if name == "default" else _template()


def _template():
    """The plotly template of the current theme (plotly_white, with the theme's sizes and contrast)."""
    import plotly.io as pio

    t = THEMES[_theme]
    template = go.layout.Template(pio.templates["plotly_white"])
    if _theme == "default":
        return template
    axis = {
        "linecolor": t["ink"],
        "linewidth": 2,
        "gridcolor": t["grid"],
        "tickfont": {"color": t["ink"]},
        "title": {"font": {"color": t["ink"]}},
    }
    template.layout.update(font={"size": t["font"], "color": t["ink"]}, xaxis=axis, yaxis=axis)
    template.layout.annotationdefaults = {"font": {"size": t["font"] - 2, "color": t["ink"]}}
    template.data.scatter = [go.Scatter(line={"width": t["line"]}, marker={"size": t["marker"]})]
    template.data.bar = [go.Bar(marker={"line": {"width": t["bar_line"]}})]
    return template


def _wrap(title: str, width_px: float, size: int) -> str:
    """Break a title into lines that fit `width_px` at font `size` (a character is ~0.55 em wide)."""
    per_line = max(20, int(width_px / (0.55 * size)))
    lines, line = [], ""
    for word in title.split(" "):
        if line and len(line) + 1 + len(word) > per_line:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "<br>".join([*lines, line])


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def kind_color(kind: str) -> str:
    return KIND_COLORS.get(kind, "#AAAAAA")


def kind_label(kind: str) -> str:
    return KIND_LABELS.get(kind, kind.replace("_", " "))


def style(fig: go.Figure, title: str, xaxis: str | None = None, yaxis: str | None = None, height=None):
    """The package's figure defaults: a title, axis titles, presentation-size fonts, a white background; in the
    projector theme (use_theme) larger, with long titles broken over lines and the top margin grown to fit; at most
    MAX_HEIGHT pixels tall."""
    top = 70
    if _theme != "default":
        title = _wrap(title, (fig.layout.width or 900) - 110, TITLE_SIZE)
        lines = title.count("<br>") + 1
        top = 40 + int(1.3 * TITLE_SIZE * lines)
        if height is not None:
            height += top - 70 + 10 * (FONT_SIZE - 16)  # room for the larger title and tick labels
    fig.update_layout(
        title={"text": title, "font": {"size": TITLE_SIZE}},
        font={"size": FONT_SIZE},
        template="plotly_white" if _theme == "default" else _template(),
        margin={"l": 80, "r": 30, "t": top, "b": 60},
        legend={"font": {"size": FONT_SIZE - 2}},
    )
    if height is not None:
        fig.update_layout(height=min(height, MAX_HEIGHT))
    if xaxis is not None:
        fig.update_xaxes(title_text=xaxis)
    if yaxis is not None:
        fig.update_yaxes(title_text=yaxis)
    return fig


# ------------------------------------------------------------------------------------------------- timelines


def _lanes(events: list) -> dict[int, tuple[float, float]]:
    """Where each event of one rank sits in its row (offset, width; the row spans -0.5 .. 0.5).

    Compute spans take the upper half. Communication takes the lower half, in as many lanes as there are
    operations in flight at once (greedy: an operation goes to the first lane free when it starts), so an
    asynchronous all-reduce or a send overlapping its recv never hides another.
    """
    lanes: list[float] = []  # when the last operation in each lane ends
    lane_of = {}
    for e in events:
        if e.is_compute:
            continue
        free = [k for k, busy_until in enumerate(lanes) if busy_until <= e.start]
        if free:
            lanes[free[0]] = e.start + e.duration
        else:
            lanes.append(e.start + e.duration)
        lane_of[id(e)] = free[0] if free else len(lanes) - 1
    height = 0.42 / max(len(lanes), 1)
    return {id(e): (0.02, 0.4) if e.is_compute else (-0.02 - (lane_of[id(e)] + 1) * height, height) for e in events}


def timeline(
    trace: Trace,
    title: str = "What each rank did",
    kinds: Sequence[str] | None = None,
    unit: str = "ms",
    show_labels: bool = True,
    axis: str | None = None,
) -> go.Figure:
    """A Gantt chart of a launch: ranks as rows (rank 0 on top), one bar per event, coloured by kind.

    In each rank's row, compute spans are drawn above and communication below (in lanes when several operations
    are in flight at once). Times are measured in the ranks, relative to the first event. Hover shows the exact
    start, duration, payload bytes, peer and mesh axis. `kinds` limits the events drawn (default: all); `axis`
    keeps, of the communication, only the calls on that device-mesh axis' groups (e.g. "dp").
    """
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    t0 = trace.t0
    events = [
        e
        for e in trace.events
        if (kinds is None or e.kind in kinds) and (axis is None or e.is_compute or e.axis == axis)
    ]
    place = {}
    for rank in range(trace.world_size):
        place.update(_lanes([e for e in events if e.rank == rank]))
    fig = go.Figure()
    for kind in dict.fromkeys(e.kind for e in events):  # first-seen order keeps the legend stable
        mine = [e for e in events if e.kind == kind]
        fig.add_trace(
            go.Bar(
                name=kind_label(kind),
                orientation="h",
                y=[f"rank {e.rank}" for e in mine],
                base=[(e.start - t0) * scale for e in mine],
                x=[max(e.duration * scale, 1e-3) for e in mine],
                offset=[place[id(e)][0] for e in mine],
                width=[place[id(e)][1] for e in mine],
                marker={"color": kind_color(kind), "line": {"color": "white", "width": BAR_LINE}},
                text=[e.label for e in mine] if show_labels else None,
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,  # never rotate a label to squeeze it into a thin bar
                hovertemplate=[
                    f"rank {e.rank} · {kind_label(e.kind)} {e.label}<br>start %{{base:.3f}} {unit}<br>"
                    f"duration %{{x:.3f}} {unit}<br>payload {e.bytes} bytes"
                    + (f"<br>peer rank {e.peer}" if e.peer is not None else "")
                    + (f"<br>axis {e.axis}" if e.axis is not None else "")
                    + "<extra></extra>"
                    for e in mine
                ],
            )
        )
    ranks = [f"rank {r}" for r in range(trace.world_size)]
    # Labels too small to read at presentation size are hidden (hover still shows them), not shrunk to specks.
    fig.update_layout(barmode="overlay", uniformtext={"minsize": FONT_SIZE - 4, "mode": "hide"})
    fig.update_yaxes(categoryorder="array", categoryarray=ranks[::-1])
    height = 140 + 80 * trace.world_size
    return style(fig, title, f"time since the first event ({unit})", "compute above, communication below", height)


# ------------------------------------------------------------------------------------------- shard diagrams


def chunk_grid(
    panels: Sequence[tuple[str, Sequence[Sequence[str | None]], Sequence[Sequence[int]]]],
    title: str,
    arrows: Sequence[tuple[int, int, int]] = (),
    row_names: Sequence[str] | None = None,
) -> go.Figure:
    """Shard diagrams side by side: one row per rank, one cell per chunk, coloured by where its data came from.

    panels: (subtitle, texts, owners) each; texts[r][c] is the label of rank r's chunk c (None: holds nothing);
            owners[r][c] is the rank the data came from, FULL_SUM for a sum over all ranks, PARTIAL_SUM for a
            sum over some of them.
    arrows: (from_rank, chunk, to_rank) in the last panel: a chunk in flight from one rank to another.
    """
    rows, cols = len(panels[0][1]), len(panels[0][1][0])
    row_names = list(row_names or [f"rank {r}" for r in range(rows)])
    shapes, annotations, tick_x, tick_text, seen = [], [], [], [], set()
    for k, (subtitle, texts, owners) in enumerate(panels):
        x_offset = k * (cols + 1)
        annotations.append(dict(x=x_offset + cols / 2, y=rows + 0.15, text=f"<b>{subtitle}</b>", showarrow=False))
        for r in range(rows):
            for c in range(cols):
                text, owner = texts[r][c], owners[r][c]
                y = rows - 1 - r
                color = EMPTY_COLOR if text is None else owner_color(owner)
                shapes.append(
                    dict(
                        type="rect",
                        x0=x_offset + c,
                        x1=x_offset + c + 0.95,
                        y0=y,
                        y1=y + 0.9,
                        fillcolor=color,
                        line={"color": "#444"},
                    )
                )
                if text is not None:
                    seen.add(owner)
                    font = {"color": "black" if owner == PARTIAL_SUM else "white"}
                    annotations.append(dict(x=x_offset + c + 0.475, y=y + 0.45, text=text, showarrow=False, font=font))
        tick_x += [x_offset + c + 0.475 for c in range(cols)]
        tick_text += [f"c{c}" for c in range(cols)]
    annotations += _ring_arrows(arrows, rows, x_offset=(len(panels) - 1) * (cols + 1))
    fig = go.Figure()
    for owner in sorted(seen, key=lambda o: (o < 0, abs(o))):  # legend: one entry per colour meaning
        fig.add_trace(square_legend(OWNER_NAMES.get(owner, f"from rank {owner}"), owner_color(owner)))
    fig.update_layout(shapes=shapes, annotations=annotations, showlegend=True)
    fig.update_xaxes(range=[-0.2, len(panels) * (cols + 1) - 0.8], tickvals=tick_x, ticktext=tick_text, showgrid=False)
    fig.update_yaxes(range=[-0.2, rows + 0.4], tickvals=[rows - 1 - r + 0.45 for r in range(rows)], ticktext=row_names)
    fig.update_yaxes(showgrid=False, zeroline=False)
    return style(fig, title, "chunk of the tensor each rank holds", None, height=170 + 60 * rows)


def _arrow(x: float, y_from: float, y_to: float) -> dict:
    """A red arrow annotation from (x, y_from) to (x, y_to), in data coordinates."""
    return dict(
        x=x,
        y=y_to,
        ax=x,
        ay=y_from,
        xref="x",
        yref="y",
        axref="x",
        ayref="y",
        text="",
        showarrow=True,
        arrowhead=3,
        arrowsize=1.5,
        arrowwidth=2.5,
        arrowcolor="#D62728",
        font={"color": "#D62728"},
    )


def _ring_arrows(arrows: Sequence[tuple[int, int, int]], rows: int, x_offset: float) -> list[dict]:
    """Chunks in flight (from_rank, chunk, to_rank) in a panel starting at x_offset: down to the next row, or out
    at the bottom and back in at the top where the ring wraps around."""
    row_middle = lambda r: rows - 1 - r + 0.45  # noqa: E731
    drawn = []
    for from_rank, chunk, to_rank in arrows:
        x = x_offset + chunk + 0.88  # at the cell's right edge, clear of its label
        if to_rank > from_rank:
            drawn.append(_arrow(x, row_middle(from_rank) - 0.2, row_middle(to_rank) + 0.2))
        else:
            drawn += [_arrow(x, row_middle(from_rank) - 0.2, -0.15), _arrow(x, rows + 0.05, row_middle(to_rank) + 0.2)]
    return drawn


def square_legend(name: str, color: str) -> go.Scatter:
    """A legend entry only (no data): a coloured square, for figures drawn with shapes."""
    return go.Scatter(
        x=[None], y=[None], mode="markers", marker={"size": 14, "symbol": "square", "color": color}, name=name
    )


FULL_SUM, PARTIAL_SUM = -1, -2
PARTIAL_COLOR = "#C7C7C7"
OWNER_NAMES = {FULL_SUM: "sum over all ranks", PARTIAL_SUM: "partial sum"}


def owner_color(owner: int) -> str:
    if owner == FULL_SUM:
        return REDUCED_COLOR
    if owner == PARTIAL_SUM:
        return PARTIAL_COLOR
    return rank_color(owner)
