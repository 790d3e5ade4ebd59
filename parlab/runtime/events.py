"""The rank side of a live timeline (parlab/views/live.py): a rank's events, sent to the parent while it runs.

No plotly, no IPython: this runs in every rank that a live timeline watches.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from parlab.core.trace import Event


class EventStream:
    """Rank side: `comm.event_hook`. Sends {"rank", "events": [(index, Event), ...]} through `send`: the events
    recorded since the last send, and again the ones that had not finished then (their end is known now)."""

    INTERVAL = 0.1  # seconds between two sends of one rank

    def __init__(self, send: Callable[[dict], None], rank: int):
        self.send, self.rank = send, rank
        self.sent, self.unfinished, self.last = 0, [], 0.0

    def __call__(self, events: list[Event]) -> None:
        now = time.perf_counter()
        if now - self.last >= self.INTERVAL:
            self.last = now
            self.flush(events)

    def flush(self, events: list[Event]) -> None:
        if len(events) < self.sent:  # comm.reset_trace() in rank code: start over
            self.sent, self.unfinished = 0, []
        indices = sorted({*self.unfinished, *range(self.sent, len(events))})
        payload = [(i, events[i]) for i in indices]
        self.unfinished = [i for i in indices if events[i].end is None]
        self.sent = len(events)
        if payload:
            self.send({"rank": self.rank, "events": payload})
