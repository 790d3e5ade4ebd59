"""parlab.live: the timeline drawn from events the ranks stream while they run."""

import time

import pytest
import torch

from parlab import live
from parlab.core import comm
from parlab.core.trace import Event
from parlab.runtime.events import EventStream
from parlab.runtime.launcher import launch
from parlab.views.live import LiveTimeline


def test_event_stream_sends_new_events_and_resends_unfinished_ones_at_most_every_interval():
    sent = []
    stream = EventStream(sent.append, rank=3)
    events = [Event(3, "forward", 0.0, 1.0, label="F0"), Event(3, "all_reduce", 1.0, None, label="bucket 0")]
    stream(events)  # first call: sends both
    events.append(Event(3, "backward", 1.5, None))
    stream(events)  # within the interval: nothing
    assert [[i for i, _ in s["events"]] for s in sent] == [[0, 1]] and sent[0]["rank"] == 3
    events[1].end = 2.0  # the all-reduce finished
    stream.last = 0.0
    stream(events)  # the unfinished all-reduce again (now with its end), and the new backward
    assert [i for i, _ in sent[1]["events"]] == [1, 2] and sent[1]["events"][0][1].end == 2.0
    stream.last = 0.0
    stream(events)
    assert [i for i, _ in sent[2]["events"]] == [2]  # only the backward is still running


def _steps(n: int, seconds: float) -> bool:
    """Rank code: n compute spans of `seconds` each, an all-reduce after each; says whether events were streamed."""
    x = torch.ones(4)
    for i in range(n):
        with comm.span(f"F{i}", kind="forward"):
            time.sleep(seconds)
        comm.all_reduce(x, label=f"step {i}")
    return comm.event_hook is not None


class _Captured(LiveTimeline):
    """A live timeline whose drafts are kept instead of displayed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, show=True, interval=0.1, **kwargs)
        self.shown = []

    def _display(self, figure, final=False):
        self.shown.append(figure)
        self.final = final


def test_a_live_timeline_gains_events_while_the_ranks_run_and_ends_with_the_whole_trace():
    launch(_steps, 2, 1, 0.0)  # a warm rank server: the drafts below are the run's, not the server's start
    with _Captured(2, title="demo") as view:
        # 1.2 s of run against drafts at most every 0.1 s: at least three even where a busy machine slows each
        # redraw (8 steps of 0.06 s gave two drafts in a loaded run of the suite)
        results = launch(_steps, 2, 8, 0.15)
        final = view.finish(results.trace)
    assert comm.event_sink is None  # the sink is gone after the launch
    assert all(results)  # the ranks streamed (and without a live view they do not: last test)
    drafts = view.shown[1:-1]  # [0] is the empty figure shown at the start, [-1] the final one
    counts = [sum(len(bar.x) for bar in fig.data) for fig in drafts]
    assert len(drafts) >= 3 and counts == sorted(counts) and 0 < counts[0] < len(results.trace), counts
    nows = [fig.layout.shapes[0].x0 for fig in drafts]  # the red "now" line moves right
    assert nows == sorted(nows) and nows[-1] > nows[0] > 0
    assert view.final and final is view.shown[-1] and sum(len(bar.x) for bar in final.data) == len(results.trace) == 32
    assert final.layout.title.text == "demo: what each rank did (measured)" and not final.layout.shapes


def test_without_a_live_view_ranks_stream_nothing_and_bad_scheme_names_fail_before_launch():
    assert list(launch(_steps, 2, 1, 0.0)) == [False, False]
    with pytest.raises(ValueError, match="unknown scheme"):
        live("no-such-scheme", world_size=2)


def test_a_draft_marks_a_posted_send_where_it_started_and_draws_its_bar_once_waited_for():
    view = LiveTimeline(2, show=False)
    send = Event(0, "send", 1.0, None, bytes=64, label="F0", peer=1)
    recv = Event(1, "recv", 1.0, None, bytes=64, label="F0", peer=0)
    view.receive({"rank": 0, "events": [(0, Event(0, "forward", 0.0, 1.0)), (1, send)]})
    view.receive({"rank": 1, "events": [(0, recv)]})
    draft = view.figure(now=3.0)
    bars = {t.name: t for t in draft.data if t.type == "bar"}
    (marks,) = [t for t in draft.data if t.type == "scatter"]
    assert "send" not in bars and list(marks.x) == [1000.0] and list(marks.y) == ["rank 0"]
    assert list(bars["recv"].x) == [2000.0]  # a blocking receive still running: drawn up to now
    view.receive({"rank": 0, "events": [(1, Event(0, "send", 1.0, 1.5, bytes=64, label="F0", peer=1))]})
    later = view.figure(now=3.0)
    assert not [t for t in later.data if t.type == "scatter"]
    assert [list(t.x) for t in later.data if t.name == "send"] == [[500.0]]


def test_send_and_recv_colours_differ_by_a_graphics_contrast():
    from parlab.views import plots

    def luminance(color):
        channels = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    low, high = sorted(luminance(plots.kind_color(k)) for k in ("send", "recv"))
    assert (high + 0.05) / (low + 0.05) >= 3.0  # WCAG's contrast for graphics


def test_a_posted_send_marks_the_same_time_axis_as_the_bars():
    view = LiveTimeline(2, show=False)
    view.receive({"rank": 0, "events": [(0, Event(0, "forward", 1.0, 2.0)), (1, Event(0, "send", 1.5, None, peer=1))]})
    draft = view.figure(now=3.0)
    (bar,) = [t for t in draft.data if t.type == "bar"]
    (marks,) = [t for t in draft.data if t.type == "scatter"]
    assert list(bar.base) == [0.0] and list(marks.x) == [500.0]  # both counted from the first bar's start
