"""Live timelines: the timeline draws itself in the notebook while the ranks run.

    import parlab
    results = parlab.live(my_rank_fn, 4)                                      # any rank code, like parlab.launch
    results, report = parlab.live("pp", world_size=4, pace="unit=400ms")      # a scheme, slowed down for a class
    results, report = launch_scheme("dp", live=True, pace="unit=300ms")       # the same, from parlab.runs

How it works. Ranks record events with parlab.core.comm as always. When a live timeline is watching, the launcher sets
`comm.event_hook` in each rank to an `EventStream` (parlab/runtime/events.py): as events are recorded it sends the new
and the unfinished ones to the parent over the pipe the progress bar already uses, at most every `EventStream.INTERVAL`
seconds. In the parent, the launcher hands them to `comm.event_sink`, here `LiveTimeline.receive`, and ticks it while it
waits; the figure is redrawn at most every `interval` seconds: a lane per rank, compute above and communication below
(as `plots.timeline`), operations still running drawn up to now (a send posted and not yet waited for as a mark
where it was posted), and the current time as a red line.

Headless (nbval, nbclient, a script) nothing waits: under pytest, or outside a notebook, no intermediate figure is
drawn, and the finished timeline (`plots.timeline` of the whole trace) is the cell's one output. In JupyterLab the
drafts are redrawn in an ipywidgets Output under the cell, and the finished figure is then shown as the cell's
ordinary output, which is also what the saved notebook holds.

The rank side (`EventStream`, parlab/runtime/events.py) imports neither plotly nor IPython.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from collections.abc import Callable
from typing import Any

from parlab.core import comm
from parlab.core.trace import Event, Trace


def _watched() -> bool:
    """True in a Jupyter kernel that is not run by pytest (nbval): only there are drafts worth drawing."""
    import sys

    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
    return in_kernel and "PYTEST_CURRENT_TEST" not in os.environ


class LiveTimeline:
    """Parent side: a figure redrawn from the events the ranks stream (use as a context manager around a launch).

    show: "auto" (draw drafts in a watched notebook, else only the final figure), True (always display),
          False (never display: tests read `drafts` and `figure()`).
    drafts: (seconds since the first event, number of events known) at each redraw, for tests and curiosity.
    """

    def __init__(self, world_size: int, title: str = "Live", interval: float = 0.3, show: bool | str = "auto"):
        self.world_size, self.title, self.interval = world_size, title, interval
        self.show = _watched() if show == "auto" else bool(show)
        self.display_final = show == "auto" and _in_kernel()
        self.events: dict[tuple[int, int], Event] = {}
        self.drafts: list[tuple[float, int]] = []
        self.handle, self.last_draw, self._previous = None, 0.0, None

    def __enter__(self) -> LiveTimeline:
        importlib.import_module("parlab.views.plots")  # plotly's import takes a second: not in the middle of the run

        self._previous, comm.event_sink = comm.event_sink, self.receive
        if self.show:
            self._display(self.figure())
        return self

    def __exit__(self, *exc) -> None:
        comm.event_sink = self._previous

    def receive(self, update: dict | None) -> None:
        """comm.event_sink: a rank's events, or None (a tick while the launcher waits)."""
        if update is not None:
            for index, event in update["events"]:
                self.events[(update["rank"], index)] = event
        now = time.perf_counter()
        if self.events and now - self.last_draw >= self.interval:
            self.drafts.append((now - min(e.start for e in self.events.values()), len(self.events)))
            if self.show:
                self._display(self.figure(now))
            self.last_draw = time.perf_counter()  # a slow redraw does not starve the reading of the pipe

    def trace(self, now: float | None = None) -> Trace:
        """What is known so far; an operation still running is drawn up to `now`, except a send not yet waited
        for, which is no bar at all (see `pending_sends`)."""
        now = time.perf_counter() if now is None else now
        events = [
            e if e.end is not None else dataclasses.replace(e, end=max(now, e.start))
            for e in self.events.values()
            if not _pending_send(e)
        ]
        return Trace(events, self.world_size)

    def pending_sends(self) -> list:
        """Sends posted and not yet waited for. A rank goes on computing after posting one (isend), so a bar
        growing to "now" would claim a busy link for time nobody measured: the draft marks where each was posted,
        and its bar appears once the wait returns (its end is then known)."""
        return [e for e in self.events.values() if _pending_send(e)]

    def figure(self, now: float | None = None):
        """The draft: plots.timeline of what is known, with the current time as a red line."""
        import plotly.graph_objects as go

        from parlab.views import plots

        now = time.perf_counter() if now is None else now
        trace = self.trace(now)
        fig = plots.timeline(trace, title=f"{self.title}: {len(trace)} events so far", show_labels=False)
        posted = self.pending_sends()
        # The marks share the bars' time axis (plots.timeline counts from trace.t0); with no bar yet, from the first.
        t0 = trace.t0 if len(trace) else min((e.start for e in posted), default=now)
        if posted:
            fig.add_trace(
                go.Scatter(
                    name="send posted, not yet waited for",
                    x=[(e.start - t0) * 1e3 for e in posted],
                    y=[f"rank {e.rank}" for e in posted],
                    mode="markers",
                    marker={"symbol": "triangle-right", "size": 14, "color": plots.kind_color("send")},
                    hovertemplate=[
                        f"rank {e.rank} posted send {e.label} to rank {e.peer}<extra></extra>" for e in posted
                    ],
                )
            )
        at = (now - t0) * 1e3 if len(trace) or posted else 0.0
        fig.add_vline(x=at, line={"color": "#D62728", "width": 3})
        fig.update_xaxes(range=[0, max(at, 1.0) * 1.05])
        return fig

    def finish(self, trace: Trace):
        """The finished timeline of the whole run replaces the drafts (it is what a saved notebook keeps)."""
        from parlab.views import plots

        final = plots.timeline(trace, title=f"{self.title}: what each rank did (measured)")
        if self.show or self.display_final:
            self._display(final, final=True)
        return final

    def _display(self, figure, final: bool = False) -> None:
        """Drafts go into an ipywidgets Output whose outputs the kernel replaces (JupyterLab's plotly renderer
        draws a figure once and ignores updates of it in place; an Output widget re-renders its new output). The
        final figure is an ordinary output of the cell, the one a saved notebook and nbval keep; the emptied
        Output stays behind it, showing nothing."""
        import json

        import plotly.io as pio
        from IPython.display import display

        bundle = {
            "application/vnd.plotly.v1+json": {**json.loads(pio.to_json(figure, validate=False)), "config": {}},
            "text/plain": f"<{figure.layout.title.text}>",
        }
        if final:
            if self.handle is not None:
                self.handle.outputs = ()
            display(bundle, raw=True)
            return
        if self.handle is None:
            import ipywidgets

            self.handle = ipywidgets.Output()
            display(self.handle)
        self.handle.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)


def _in_kernel() -> bool:
    import sys

    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _pending_send(event: Event) -> bool:
    return event.kind == "send" and event.end is None


def launch_live(fn: Callable[..., Any], world_size: int, *args: Any, title: str | None = None, **kwargs: Any):
    """parlab.launch(fn, world_size, ...) with a live timeline (what parlab.live(fn, ...) does); returns its Results."""
    from parlab.runtime.launcher import launch

    name = getattr(fn, "__name__", "rank code")
    with LiveTimeline(world_size, title=title or f"{name} on {world_size} ranks") as view:
        results = launch(fn, world_size, *args, **kwargs)
        view.finish(results.trace)
    return results
