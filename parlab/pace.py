"""An emulated device and link: timelines that show the schedule and the network, not the CPU scheduler.

On a laptop or Binder, 4 ranks share 1-2 cores: a rank's measured compute time is mostly time spent waiting for a
core, and a pipeline's measured bubble says more about the operating system than about the schedule. A paced run
keeps the data, the numerics and the byte counts real, and holds the *time* of each traced operation to a model:

    compute span of kind k      held to  cost[k] x unit          (F = 1, B = 2, BI = BW = 1: the ideal timeline's
                                                                  unit costs; optimizer and other spans are not held)
    communication of n bytes    held to  alpha + n / bandwidth   (the alpha-beta link model), after the real transfer;
                                                                  a rank's messages share its one link, one after
                                                                  another (a message waits for the link to be free)

"Held" means: the real work runs first; if it took less than the model says, the rank sleeps for the rest, so a
waiting rank gives its core to the others. If the real work took longer than the model (the pace is too fast for
this machine), the span keeps its real length and is marked `extra["overrun"]`; reports count those and say so.

    from parlab import pace
    with pace.paced(pace.Pace(unit=0.05, alpha=1e-3, bandwidth=50e6)):   # in rank code
        ...                                                               # every comm call and comm.span is paced

Schemes take it as an option: `python -m parlab run pp --pace` (the default model) or `--pace unit=50ms,alpha=1ms,
bandwidth=50MB/s`; the JSON report then has `paced` (the model) and `paced_overruns`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from parlab.trace import Event

UNIT_COSTS = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}


@dataclass(frozen=True)
class Pace:
    """The emulated device and link. unit: seconds of one forward (F); alpha: seconds of latency per message;
    bandwidth: bytes per second of a link."""

    unit: float = 0.05
    alpha: float = 1e-3
    bandwidth: float = 50e6

    def __post_init__(self):
        # A modelled time must be one a lesson can wait for: a unit of at most a minute, a latency of at most ten
        # seconds, at least 1 KB/s (a 1 MB message in under 20 minutes); nan and inf are refused.
        for name, value, low, high, what in [
            ("unit", self.unit, 1e-6, 60.0, "between 1us and 60s"),
            ("alpha", self.alpha, 0.0, 10.0, "between 0 and 10s"),
            ("bandwidth", self.bandwidth, 1e3, 1e15, "between 1KB/s and 1e6GB/s"),
        ]:
            if not (low <= value <= high):  # false for nan too
                raise ValueError(f"pace {name}={value:g} must be {what}")

    def compute_seconds(self, kind: str) -> float:
        """Modelled duration of a compute span of this kind (0: not held)."""
        return UNIT_COSTS.get(kind, 0) * self.unit

    def comm_seconds(self, nbytes: int) -> float:
        """Modelled duration of a message or collective payload of `nbytes`: alpha + nbytes / bandwidth."""
        return self.alpha + nbytes / self.bandwidth

    def describe(self) -> str:
        return (
            f"emulated device: F = {self.unit * 1e3:g} ms, B = 2F, BI = BW = F; emulated link: alpha = "
            f"{self.alpha * 1e3:g} ms, bandwidth = {self.bandwidth / 1e6:g} MB/s"
        )


_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9}


def parse(text: str) -> Pace | None:
    """'' -> None (not paced); 'default' -> Pace(); 'unit=20ms,alpha=1ms,bandwidth=50MB/s' -> that model."""
    text = text.strip()
    if not text:
        return None
    if text == "default":
        return Pace()
    values = {}
    for item in text.split(","):
        match = re.fullmatch(r"\s*(unit|alpha|bandwidth)\s*=\s*([0-9.eE+-]+)\s*([A-Za-z/]*)\s*", item)
        if not match or (match[3] and match[3] not in _UNITS):
            raise ValueError(
                f"pace {text!r}: expected 'default' or items like unit=20ms, alpha=1ms, bandwidth=50MB/s, "
                f"got {item.strip()!r}"
            )
        if match[1] in values:
            raise ValueError(f"pace {text!r}: {match[1]} is given twice")
        try:
            values[match[1]] = float(match[2]) * _UNITS.get(match[3], 1.0)
        except ValueError:
            raise ValueError(f"pace {text!r}: {match[2]!r} is not a number") from None
    return Pace(**values)


# ------------------------------------------------------------------------------------ what parlab.comm calls

_model: Pace | None = None  # the pace of this rank, while `paced` is active


@contextmanager
def paced(model: Pace | None) -> Iterator[None]:
    """Pace every traced operation of this rank inside the block (None: leave timing alone)."""
    global _model, _link_free
    previous, _model, _link_free = _model, model, 0.0
    try:
        yield
    finally:
        _model = previous


def active() -> Pace | None:
    return _model


_slept: dict[int, float] = {}  # seconds each open span has slept in `reached` (not real work)


def _hold_until(event: Event, target_end: float) -> None:
    now = time.perf_counter()
    busy = now - event.start - _slept.pop(id(event), 0.0)  # the real work the span did
    if busy > target_end - event.start:
        event.extra["overrun"] = busy - (target_end - event.start)  # it did not fit in the modelled time
    if now < target_end:
        time.sleep(target_end - now)


_open_spans: list[Event] = []  # the compute spans this rank is inside, innermost last


def enter_compute(event: Event) -> None:
    """Start of a compute span (parlab.comm.span calls this)."""
    _open_spans.append(event)


def leave_compute(event: Event) -> None:
    """End of a compute span, unpaced (its code raised)."""
    if _open_spans and _open_spans[-1] is event:
        _open_spans.pop()
    _slept.pop(id(event), None)


def hold_compute(event: Event) -> None:
    """End of a compute span: hold it to its modelled duration."""
    if _open_spans and _open_spans[-1] is event:
        _open_spans.pop()
    if _model is not None and _model.compute_seconds(event.kind) > 0:
        event.extra["paced"] = True
        _hold_until(event, event.start + _model.compute_seconds(event.kind))


def reached(fraction: float) -> None:
    """Inside a paced compute span: the work done so far is `fraction` of the span's work, so on the emulated
    device this moment comes `fraction` of the modelled duration after the span's start; wait until then.

    Without it, all the real work of a span would happen at its start and the hold at its end: an all-reduce
    started from a gradient hook halfway through backward would appear at the backward's very start.
    """
    if _model is None or not _open_spans:
        return
    event = _open_spans[-1]
    seconds = _model.compute_seconds(event.kind)
    if seconds > 0:
        wait = event.start + fraction * seconds - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
            _slept[id(event)] = _slept.get(id(event), 0.0) + wait


_link_free = 0.0  # when this rank's emulated link has finished its last message


def issue_comm(event: Event) -> None:
    """A communication call starts (parlab.comm calls this): under the link model it completes alpha + bytes /
    bandwidth after both it was issued and the link finished the rank's previous message."""
    global _link_free
    if _model is not None and event.kind != "barrier":
        ready = max(event.start, _link_free) + _model.comm_seconds(event.bytes)
        event.extra["paced_ready"] = _link_free = ready


def comm_ready_at(event: Event) -> float:
    """When a communication is complete under the link model (its real start, if not paced)."""
    return event.extra.get("paced_ready", event.start)


def hold_comm(event: Event) -> None:
    """After the real transfer: hold the call until the link model says the data has arrived."""
    if "paced_ready" in event.extra:
        event.extra["paced"] = True
        now = time.perf_counter()
        target = comm_ready_at(event)
        if now < target:
            time.sleep(target - now)  # a slower link than loopback: wait (no overrun: real transfers are fast)


def overruns(events: list[Event]) -> int:
    """How many paced spans did not fit in their modelled time."""
    return sum("overrun" in e.extra for e in events)
