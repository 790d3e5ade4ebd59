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

    from parlab.core import pace
    with pace.paced(pace.Pace(unit=0.05, alpha=1e-3, bandwidth=50e6)):   # in rank code
        ...                                                               # every comm call and comm.span is paced

Schemes take it as an option: `python -m parlab run pp --pace` (the default model), `--pace unit=50ms,alpha=1ms,
bandwidth=50MB/s`, or `--pace h100` / `--pace a100` (parlab.core.hardware: F from the model's FLOPs at the GPU's
FLOP/s x efficiency, the link NVLink's alpha + bytes / bandwidth, all slowed down so that F lasts 50 ms); the JSON
report then has `paced` (the model) and `paced_overruns`.

The clock: see "what parlab.core.comm calls" below. In short, spans and messages are placed on the emulated device's
own clock (a span starts when the device is free and its inputs have arrived, a message arrives at the time its
sender's link model says), so neither the Python between spans nor a rank waking up late on a busy core shows.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from parlab.core.trace import Event

UNIT_COSTS = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}


@dataclass(frozen=True)
class Pace:
    """The emulated device and link. unit: seconds of one forward (F); alpha: seconds of latency per message;
    bandwidth: bytes per second of a link."""

    unit: float = 0.05
    alpha: float = 1e-3
    bandwidth: float = 50e6
    profile: str = ""  # the hardware profile (parlab.core.hardware) these times come from, slowed down by time_scale
    time_scale: float = 1.0

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
        text = (
            f"emulated device: F = {self.unit * 1e3:g} ms, B = 2F, BI = BW = F; emulated link: alpha = "
            f"{self.alpha * 1e3:g} ms, bandwidth = {self.bandwidth / 1e6:g} MB/s"
        )
        if self.profile:
            text += f" ({self.profile.upper()} times, slowed down {self.time_scale:.3g}x; parlab.core.hardware)"
        return text

    @classmethod
    def from_profile(cls, name: str, forward_flops: float, world_size: int = 1, unit: float | None = None) -> Pace:
        """The proportions of a real cluster (parlab.core.hardware): F takes forward_flops at the profile's FLOP/s and
        efficiency, a message the profile's NVLink (all ranks in one node) or InfiniBand alpha + bytes /
        bandwidth; everything slowed down by the same factor so that F lasts `unit` seconds of wall time.

        unit None (not given): F lasts 50 ms, unless a message's latency alpha is longer than F, as it is for the
        small models of a lesson (a GPU runs their forward in nanoseconds, a message takes microseconds): then
        alpha lasts 50 ms and F its share of that. Either way the longer of the two is what one can watch."""
        from parlab.core.hardware import profile

        if not forward_flops > 0:  # (false for nan)
            raise ValueError(f"pace {name}: the run's forward has {forward_flops:g} FLOPs; nothing to time")
        hw = profile(name)
        intra = world_size <= hw.gpus_per_node
        hw_alpha = hw.nvlink_alpha if intra else hw.ib_alpha
        hw_forward = hw.compute_seconds(forward_flops)
        given = unit is not None
        if not given:
            unit = DEFAULT_UNIT * min(1.0, hw_forward / hw_alpha)
        if not (1e-6 <= unit <= 60.0):  # as __post_init__ would say, in the profile's words
            if given:
                raise ValueError(f"pace {name}: unit={unit:g} must be between 1us and 60s")
            raise ValueError(
                f"pace {name}: this model's forward of {forward_flops:.3g} FLOPs takes {hw_forward * 1e9:.3g} ns on "
                f"an {name.upper()}, {hw_alpha / hw_forward:.3g} times shorter than a message's latency "
                f"({hw_alpha * 1e6:g} us): slowed down until a message lasts {DEFAULT_UNIT * 1e3:g} ms, F would last "
                f"{unit * 1e9:.3g} ns, too short to hold; give the run a bigger model (--hidden, --seq, --batch)"
            )
        scale = unit / hw_forward
        alpha = hw_alpha * scale
        bandwidth = (hw.nvlink_bandwidth if intra else hw.ib_bandwidth) / scale
        if alpha > 10.0:
            raise ValueError(
                f"pace {name}: this model's forward of {forward_flops:.3g} FLOPs takes {hw_forward * 1e9:.3g} ns on "
                f"an {name.upper()}, a message's latency alone {hw_alpha * 1e6:g} us; slowed down to F = "
                f"{unit * 1e3:g} ms a message would take {alpha:.3g} s: give a smaller unit (at most "
                f"{unit * 10.0 / alpha * 1e3:.3g} ms; or leave it out) or a bigger model (--hidden, --seq, --batch)"
            )
        return cls(unit=unit, alpha=alpha, bandwidth=min(bandwidth, 1e15), profile=name, time_scale=scale)

    @property
    def latency_bound(self) -> bool:
        """A hardware profile's pace whose message latency outlasts a forward (a small model on a fast GPU)."""
        return bool(self.profile) and self.alpha > self.unit


DEFAULT_UNIT = 0.05  # seconds of wall time the longer of F and a message's latency lasts under a hardware profile

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9}


def parse(text: str, forward_flops: float | None = None, world_size: int = 1) -> Pace | None:
    """'' -> None (not paced); 'default' -> Pace(); 'unit=20ms,alpha=1ms,bandwidth=50MB/s' -> that model;
    'h100' or 'a100' -> Pace.from_profile, with the FLOPs of one forward action of the run's model;
    'h100,unit=200ms' -> the same proportions, slowed down so that F lasts 200 ms."""
    text = text.strip()
    if not text:
        return None
    if text == "default":
        return Pace()
    from parlab.core.hardware import PROFILES  # (no torch: a light import)

    name, _, rest = text.partition(",")
    if name.strip() in PROFILES:
        if forward_flops is None:
            raise ValueError(f"pace {text}: only a run that trains a model can be paced by a hardware profile")
        # A profile fixes the proportions; only the slow-down is the student's to choose (a larger unit for a
        # machine that does not keep up with F = 50 ms).
        values = _items(text, rest) if rest.strip() else {}
        if set(values) - {"unit"}:
            raise ValueError(f"pace {text!r}: a hardware profile sets alpha and bandwidth; only unit can be given")
        return Pace.from_profile(name.strip(), forward_flops, world_size, **values)
    return Pace(**_items(text, text))


def _items(text: str, items: str) -> dict[str, float]:
    """'unit=20ms,alpha=1ms' -> {'unit': 0.02, 'alpha': 0.001} (text: the whole --pace, for the error)."""
    values = {}
    for item in items.split(","):
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
    return values


# ------------------------------------------------------------------------------------ what parlab.core.comm calls
#
# The emulated device keeps its own clock. A paced compute span starts when the device is free (the model end
# of this rank's previous span) and its inputs have arrived (the model arrival of the messages received since),
# not when the Python that drives it got round to it: like a GPU, whose kernels queue up while the host is busy,
# the emulated device does not see the host's dispatch overhead, nor a sleeping rank waking up late on a busy
# core. A message arrives at the model time the *sender* computed (its send's model time + alpha + bytes /
# bandwidth), passed to the receiver beside the real transfer (through the process group's key-value store),
# so a late sender's lateness is not charged again on the receiver; a collective ends alpha + bytes / bandwidth
# after the last rank's part went onto its link (each rank leaves that time in the store too). Events are
# recorded on this clock (a span's real start is kept in extra["real_start"]). Real time comes back where the
# machine did not keep up: a span whose real work did not fit in its model (an overrun), and a span whose host
# fell more than one whole span behind its device (e.g. work outside any span); both are marked "overrun".
# Unpaced spans (the optimizer step) take their real time.

_model: Pace | None = None  # the pace of this rank, while `paced` is active
_clock: float | None = None  # model time at which this rank's device is free (None: no paced span yet)
_inputs = 0.0  # model time at which the data received since the last span had arrived
_link_free = 0.0  # when this rank's emulated link has finished its last message
_sent: dict = {}  # messages sent per (dst, group) and received per (src, group): they match in order
_received: dict = {}
_last_span: list = []  # the last held span, whose recorded end comm.span sets after the hold (see _settle)


@contextmanager
def paced(model: Pace | None) -> Iterator[None]:
    """Pace every traced operation of this rank inside the block (None: leave timing alone)."""
    global _model, _clock, _inputs, _link_free
    previous, _model = _model, model
    _clock, _inputs, _link_free = None, 0.0, 0.0
    _sent.clear(), _received.clear()
    try:
        yield
    finally:
        _settle()
        _model = previous


def active() -> Pace | None:
    return _model


def _device_now(real: float, cost: float) -> float:
    """Model time at which this rank's device can start something the host issues at real time `real`."""
    if _clock is None:
        return real
    ready = max(_clock, _inputs)
    return real if real - ready > cost else min(ready, real)  # a host a whole span behind: real time


def _settle() -> None:
    """The held spans and calls before now ended at their model end: parlab.core.comm stamped them after the sleep that
    held them (or after a real transfer the CPU scheduler made late); that lateness belongs to the emulator, not
    to the emulated device and link."""
    while _last_span:
        event, model_end = _last_span.pop()
        if event.end is not None and "overrun" not in event.extra:
            event.end = model_end


def _model_now(real: float) -> float:
    """Model time of a call the host makes at real time `real`: inside a paced span, where `reached` last said
    the span's work is (its start if never); outside, when the device is free."""
    if _open_spans and _open_spans[-1].extra.get("paced"):
        return _open_spans[-1].extra.get("reached", _open_spans[-1].start)
    return _device_now(real, _model.unit)


_slept: dict[int, float] = {}  # seconds each open span has slept in `reached` (not real work)
_open_spans: list[Event] = []  # the compute spans this rank is inside, innermost last


def enter_compute(event: Event) -> None:
    """Start of a compute span (parlab.core.comm.span calls this): a paced one starts at its device's model time."""
    _settle()
    _open_spans.append(event)
    seconds = _model.compute_seconds(event.kind) if _model is not None else 0.0
    if seconds > 0:
        event.extra["real_start"], event.extra["paced"] = event.start, True
        event.start = _device_now(event.start, seconds)
        if _clock is not None and event.start == event.extra["real_start"] > max(_clock, _inputs):
            event.extra["overrun"] = event.start - max(_clock, _inputs)  # the host fell a whole span behind


def leave_compute(event: Event) -> None:
    """End of a compute span, unpaced (its code raised)."""
    if _open_spans and _open_spans[-1] is event:
        _open_spans.pop()
    _slept.pop(id(event), None)


def hold_compute(event: Event) -> None:
    """End of a compute span: hold it to its modelled duration; the device is free again at its end."""
    global _clock
    if _open_spans and _open_spans[-1] is event:
        _open_spans.pop()
    if _model is None:
        return
    seconds = _model.compute_seconds(event.kind)
    now = time.perf_counter()
    if seconds <= 0:  # an unpaced span (optimizer step, ...): the device is busy for its real duration, from
        if _clock is not None and threading.current_thread() is threading.main_thread():  # when it was free
            _clock = max(_clock, _inputs) + (now - event.start)  # (a helper thread's spans leave the clock alone)
        return
    target = event.start + seconds
    busy = now - event.extra["real_start"] - _slept.pop(id(event), 0.0)  # the real work the span did
    if busy > seconds:
        event.extra["overrun"] = busy - seconds  # it did not fit in the modelled time: it keeps its real length
    elif target > now:
        time.sleep(target - now)
    # Past `target` without an overrun: the host started late or waited in `reached`; the device did not.
    _clock = now if busy > seconds else target
    _last_span.append((event, _clock))


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
        event.extra["reached"] = event.start + fraction * seconds
        wait = event.extra["reached"] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
            _slept[id(event)] = _slept.get(id(event), 0.0) + wait


def _store():
    """The process group's key-value store, where a sender leaves each message's model arrival time."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _message_key(src: int, dst: int, group, counts: dict, other: int) -> str:
    n = counts[(other, group)] = counts.get((other, group), 0) + 1
    return f"parlab.core.pace/{src}>{dst}/{group}/{n}"


def issue_comm(event: Event) -> None:
    """A communication call starts (parlab.core.comm calls this): under the link model it completes alpha + bytes /
    bandwidth after both it was issued and the link finished the rank's previous message. A send is issued at
    its device's model time and tells the receiver when it arrives."""
    global _link_free
    if _model is None or event.kind == "barrier":
        return
    _settle()
    issued = _model_now(event.start)
    event.extra["real_start"], event.start = event.start, min(issued, event.start)  # on the model's time axis
    if event.kind == "recv" and event.peer is not None:  # its arrival time comes from the sender (hold_comm)
        event.extra["pace_key"] = _message_key(event.peer, event.rank, event.group, _received, event.peer)
        return
    on_link = max(issued, _link_free)
    ready = on_link + _model.comm_seconds(event.bytes)
    event.extra["paced_ready"] = _link_free = ready
    store = _store()
    if store is not None and event.kind == "send" and event.peer is not None:
        store.set(_message_key(event.rank, event.peer, event.group, _sent, event.peer), repr(ready))
    elif store is not None and event.kind != "send":  # a collective: it ends when the last rank's part has
        n = _sent[("collective", event.group)] = _sent.get(("collective", event.group), 0) + 1  # gone over
        prefix = f"parlab.core.pace/collective/{event.group}/{n}/"
        store.set(prefix + str(event.rank), repr(on_link))
        event.extra["pace_collective"] = prefix


def comm_ready_at(event: Event) -> float:
    """When a communication is complete under the link model (its real start, if not paced)."""
    return event.extra.get("paced_ready", event.start)


def hold_comm(event: Event) -> None:
    """After the real transfer: hold the call until the link model says the data has arrived."""
    global _inputs
    key, store = event.extra.pop("pace_key", None), None
    if key is not None and (store := _store()) is not None and store.check([key]):
        event.extra["paced_ready"] = float(store.get(key))  # the sender's model arrival time
        store.delete_key(key)
    elif key is not None:  # a sender that is not paced: the message arrives alpha + bytes / bandwidth from now
        event.extra["paced_ready"] = time.perf_counter() + _model.comm_seconds(event.bytes)
    prefix = event.extra.pop("pace_collective", None)
    if prefix is not None and (store := _store()) is not None:  # when the last rank put its part on its link
        ranks = event.group if event.group is not None else range(_world_size())
        keys = [prefix + str(r) for r in ranks]
        starts = [float(store.get(k)) for k in keys if store.check([k])]  # (a broadcast's root may not wait)
        event.extra["paced_ready"] = max(starts) + _model.comm_seconds(event.bytes)
    if "paced_ready" in event.extra:
        event.extra["paced"] = True
        now = time.perf_counter()
        target = comm_ready_at(event)
        if now < target:
            time.sleep(target - now)  # a slower link than loopback: wait (no overrun: real transfers are fast)
        if event.kind != "send":  # what this rank now holds arrived at `target`
            _inputs = max(_inputs, target)
        if event.end is None:
            _last_span.append((event, max(target, event.start)))


def overruns(events: list[Event]) -> int:
    """How many paced spans did not fit in their modelled time."""
    return sum("overrun" in e.extra for e in events)
