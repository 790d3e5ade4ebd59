"""What the ranks did, as data: one `Event` per collective, send/recv or compute span.

Ranks record events with `parlab.core.comm` (collectives) and `parlab.core.comm.span` (compute); `parlab.launch` merges
every rank's events into one `Trace`, which the timeline plots and the byte counts read.

Times are `time.perf_counter()` seconds taken in the ranks. On one machine every rank reads the same monotonic
clock, so the ranks' events line up on one time axis.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

COMPUTE_KINDS = ("forward", "backward", "backward_input", "backward_weight", "optimizer", "compute")


@dataclass
class Event:
    """One thing a rank did.

    kind:  the collective ("all_reduce", "send", ...) or the compute kind ("forward", "backward", ...)
    bytes: payload bytes of the tensors this rank passed to torch.distributed (0 for compute)
    peer:  the other rank (global) of a send/recv; group: the ranks of the call's group (None: all ranks)
    axis:  the device-mesh axis of that group ("dp", "tp", ...), None outside a mesh
    end:   None until an asynchronous operation has been waited for
    device: where the tensors handed to torch.distributed lived ("cpu", "cuda:0"); None for compute and barriers
    """

    rank: int
    kind: str
    start: float
    end: float | None = None
    bytes: int = 0
    label: str = ""
    peer: int | None = None
    group: tuple[int, ...] | None = None
    axis: str | None = None
    extra: dict = field(default_factory=dict)
    device: str | None = None

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def duration(self) -> float:
        return (self.end if self.end is not None else self.start) - self.start


class Trace:
    """The merged events of all ranks of one launch."""

    def __init__(self, events: list[Event], world_size: int):
        self.events = sorted(events, key=lambda e: (e.start, e.rank))
        self.world_size = world_size

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        kinds = sorted({e.kind for e in self.events})
        return f"Trace({len(self.events)} events on {self.world_size} ranks: {', '.join(kinds)})"

    @property
    def t0(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    def select(
        self, kind: str | None = None, rank: int | None = None, compute: bool | None = None, axis: str | None = None
    ) -> list[Event]:
        """Events filtered by kind, rank, whether they are compute spans, and/or device-mesh axis ("dp", ...)."""
        return [
            e
            for e in self.events
            if (kind is None or e.kind == kind)
            and (rank is None or e.rank == rank)
            and (compute is None or e.is_compute == compute)
            and (axis is None or e.axis == axis)
        ]

    def of_step(self, step: int) -> Trace:
        """The events of one training step: on each rank, everything from the start of its first compute span
        tagged `step=step` (comm.span(..., step=step)) to the end of its last one, communication included."""
        events = []
        for rank in range(self.world_size):
            mine = self.select(rank=rank)
            spans = [e for e in mine if e.is_compute and e.extra.get("step") == step]
            if spans:
                start, end = min(e.start for e in spans), max(e.start + e.duration for e in spans)
                events += [e for e in mine if start <= e.start <= end]
        return Trace(events, self.world_size)

    def last_step(self) -> int:
        """The largest `step` any compute span was tagged with."""
        return max(e.extra["step"] for e in self.events if e.is_compute and "step" in e.extra)

    def bytes_per_rank(self, axis: str | None = None) -> dict[str, list[int]]:
        """For each communication kind, the payload bytes each rank passed to torch.distributed (rank order);
        axis: only the calls on that device-mesh axis' groups."""
        table: dict[str, list[int]] = defaultdict(lambda: [0] * self.world_size)
        for e in self.events:
            if not e.is_compute and (axis is None or e.axis == axis):
                table[e.kind][e.rank] += e.bytes
        return dict(sorted(table.items()))

    def count_per_rank(self, kind: str) -> list[int]:
        """How many operations of this kind each rank made."""
        counts = [0] * self.world_size
        for e in self.select(kind=kind):
            counts[e.rank] += 1
        return counts

    def span_seconds(self) -> float:
        """Wall time from the first event's start to the last event's end."""
        if not self.events:
            return 0.0
        return max(e.start + e.duration for e in self.events) - self.t0
