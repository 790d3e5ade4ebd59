"""Figure data (nbval does not compare plotly output, so the figures are checked here)."""

import plotly.graph_objects as go
import pytest
import torch

from parlab.core.trace import Event, Trace
from parlab.lessons.collectives import draw_collective, draw_ring_step, show_collective
from parlab.schemes.collectives import ring_step_sends
from parlab.views import plots


def _trace():
    events = [
        Event(0, "forward", 0.0, 1.0, label="F0"),
        Event(0, "all_reduce", 0.5, 2.0, bytes=80, label="bucket 0"),
        Event(0, "all_reduce", 1.0, 3.0, bytes=80, label="bucket 1"),  # in flight with bucket 0
        Event(0, "all_reduce", 2.5, 3.5, bytes=80, label="bucket 2"),  # bucket 0 is done: reuses its lane
        Event(1, "send", 0.0, 1.0, bytes=8, peer=0),
    ]
    return Trace(events, 2)


def test_timeline_has_one_trace_per_kind_with_every_event_and_readable_names():
    fig = plots.timeline(_trace(), title="t")
    names = [bar.name for bar in fig.data]
    assert names == ["forward", "send", "all-reduce"]  # in order of first appearance
    assert sum(len(bar.x) for bar in fig.data) == 5
    assert fig.layout.title.text == "t" and fig.layout.xaxis.title.text == "time since the first event (ms)"
    forward = fig.data[0]
    assert list(forward.base) == [0.0] and list(forward.x) == [1000.0]  # ms from the first event


def test_timeline_filters_communication_by_mesh_axis():
    events = [
        Event(0, "backward", 0.0, 1.0),
        Event(0, "all_reduce", 0.1, 0.2, bytes=8, group=(0, 2), axis="dp", label="bucket 0"),
        Event(0, "all_reduce", 0.3, 0.4, bytes=8, group=(0, 1), axis="tp", label="f bwd mlp 0"),
    ]
    trace = Trace(events, 4)
    assert [e.label for e in trace.select(axis="dp")] == ["bucket 0"]
    assert trace.bytes_per_rank(axis="tp") == {"all_reduce": [8, 0, 0, 0]}
    fig = plots.timeline(trace, axis="dp")
    labels = [label for bar in fig.data for label in bar.text]
    assert labels == ["", "bucket 0"]  # compute spans stay; only the dp axis' communication is drawn
    assert "axis dp" in fig.data[1].hovertemplate[0]


def test_timeline_puts_overlapping_communication_in_separate_lanes():
    fig = plots.timeline(_trace())
    reduce = next(bar for bar in fig.data if bar.name == "all-reduce")
    offsets = list(reduce.offset)
    assert offsets[0] != offsets[1]  # buckets 0 and 1 overlap in time: two lanes
    assert offsets[2] == offsets[0]  # bucket 2 starts after bucket 0 ended: back in its lane
    assert all(o < 0 for o in offsets)  # communication below the compute spans
    assert next(bar for bar in fig.data if bar.name == "forward").offset[0] > 0


def test_kind_and_rank_colours_are_fixed():
    assert plots.kind_color("forward") == plots.KIND_COLORS["forward"]
    assert plots.rank_color(1) == plots.RANK_COLORS[1] == plots.rank_color(1 + len(plots.RANK_COLORS))
    assert plots.kind_label("backward_input") == "backward (input grads)"


def test_collective_diagram_colours_cells_by_origin():
    results = show_collective("all_gather", 4)
    fig = draw_collective("all_gather", results)
    assert len(fig.layout.shapes) == 2 * 4 * 4  # before and after panels, 4 ranks x 4 chunks
    after = fig.layout.shapes[16:]
    for rank in range(4):  # after an all-gather chunk c of every rank came from rank c
        for chunk in range(4):
            assert after[rank * 4 + chunk].fillcolor == plots.rank_color(chunk)
    assert fig.layout.title.text.startswith("all-gather on 4 ranks")


def test_ring_step_arrows_follow_the_ring():
    assert ring_step_sends(4, 0) == []
    assert ring_step_sends(4, 1) == [(0, 0, 1), (1, 1, 2), (2, 2, 3), (3, 3, 0)]
    histories = [[torch.full((4,), 2.0**r) for _ in range(7)] for r in range(4)]
    fig = draw_ring_step(histories, 1)
    arrows = [a for a in fig.layout.annotations if a.showarrow]
    assert len(arrows) == 5  # 4 sends; the wrap-around 3 -> 0 leaves at the bottom and re-enters at the top
    assert "reduce-scatter step 1 of 3" in fig.layout.title.text


def _ring_steps(P=4):
    """What ring_steps reads from a causal contiguous ring run: rank r holds rank (r - s)'s K/V at step s."""
    held = [[(r - s) % P for r in range(P)] for s in range(P)]
    tiles = [(r, s, r, (r - s) % P) for s in range(P) for r in range(P) if (r - s) % P <= r]
    return {"held": held, "tiles": tiles, "world_size": P, "layout": "contiguous"}


def test_projector_theme_is_larger_keeps_the_palette_and_the_default_look_comes_back():
    default = plots.style(go.Figure(), "t", "x", "y", height=400)
    assert default.layout.font.size == 16 and default.layout.title.font.size == 20 and default.layout.height == 400
    palette = list(plots.RANK_COLORS), dict(plots.KIND_COLORS)
    long_title = "Interleaved 1F1B on 4 ranks, paced: the ideal timeline above and the measured one below, step 3"
    try:
        plots.use_theme("projector")
        fig = plots.style(go.Figure(), long_title, "x", "y", height=400)
        bars = plots.timeline(_trace())
        assert plots.theme() == "projector"
        assert fig.layout.font.size == 22 and fig.layout.title.font.size == 26 and fig.layout.height > 400
        lines = fig.layout.title.text.split("<br>")  # a long title is broken over lines, the top margin holds them
        assert len(lines) >= 2 and " ".join(lines) == long_title
        assert fig.layout.margin.t >= 1.3 * 26 * len(lines)
        assert fig.layout.template.layout.font.color == "#000000"  # black ink: high contrast
        assert bars.data[0].marker.line.width == 1.5  # thicker outlines between bars
        assert (list(plots.RANK_COLORS), dict(plots.KIND_COLORS)) == palette
        with pytest.raises(ValueError, match="unknown theme 'dark'"):
            plots.use_theme("dark")
    finally:
        plots.use_theme("default")
    again = plots.style(go.Figure(), "t", "x", "y", height=400)
    assert again.to_plotly_json() == default.to_plotly_json()
    assert plots.timeline(_trace()).data[0].marker.line.width == 0.5


def test_no_figure_is_taller_than_a_slide_holds():
    """A 1280x720 slide holds a figure of MAX_HEIGHT and the line that drew it; many rows get shorter rows."""
    assert plots.style(go.Figure(), "t", height=300).layout.height == 300
    assert plots.style(go.Figure(), "t", height=130 + 170 * 8).layout.height == plots.MAX_HEIGHT <= 720 - 100
    eight_ranks = plots.timeline(Trace([Event(r, "forward", 0.0, 1.0) for r in range(8)], 8))
    assert eight_ranks.layout.height == plots.MAX_HEIGHT < 140 + 80 * 8  # 8 rows of ranks, each a little shorter


def test_lesson_04_ring_panel_titles_cannot_overlap_at_any_font_size():
    from parlab.lessons.sequence_parallel import draw_ring_step

    for theme in ("default", "projector"):
        try:
            plots.use_theme(theme)
            fig = draw_ring_step(_ring_steps(), 1)
        finally:
            plots.use_theme("default")
        kv, tiles = [a for a in fig.layout.annotations if a.name == "panel title"]
        assert "K/V block" in kv.text and "score tiles done" in tiles.text
        # One ends where the K/V panel ends, the other starts where the tiles start, with a gap between:
        # whatever the font, the K/V title grows leftwards and the tiles' title rightwards.
        assert kv.xanchor == "right" and tiles.xanchor == "left" and kv.x < tiles.x
        assert kv.yanchor == tiles.yanchor == "bottom" and fig.layout.yaxis.range[1] > kv.y + 1
