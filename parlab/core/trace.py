"""What the ranks did, as data: one `Event` per collective, send/recv or compute span.

Ranks record events with `parlab.core.comm` (collectives) and `parlab.core.comm.span` (compute); `parlab.launch` merges
every rank's events into one `Trace`, which the timeline plots and the byte counts read.

Times are `time.perf_counter()` seconds taken in the ranks. On one machine every rank reads the same monotonic
clock, so the ranks' events line up on one time axis.

A trace is saved and loaded as JSON Lines (`Trace.save(path)`, `Trace.load(path)`), so that a run recorded at home
replays in class (`parlab.replay("run.jsonl")`). The format, version 1: the first line is a header
`{"format": "parlab-trace", "version": 1, "world_size": N, "events": E}`, then one JSON object per event with the
fields of `Event` (a tuple, e.g. `group`, is stored as a list and read back as a tuple; `extra` holds JSON values).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

FORMAT, VERSION = "parlab-trace", 1
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

    def save(self, path: str | Path) -> Path:
        """Write the trace as JSON Lines (the format in the module docstring); returns the path."""
        path = Path(path)
        header = {"format": FORMAT, "version": VERSION, "world_size": self.world_size, "events": len(self.events)}
        lines = [json.dumps(header)]
        for event in self.events:
            try:
                lines.append(json.dumps(asdict(event), allow_nan=False))
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"event {event.kind} of rank {event.rank} holds a value JSON cannot keep: {exc}"
                ) from exc
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace written by `save`; a ValueError names what is wrong with a file that is not one."""
        path = Path(path)
        lines = path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"{path}: not a parlab trace (its first line is no {FORMAT!r} header)")
        if header.get("version") != VERSION:
            raise ValueError(f"{path}: trace format version {header.get('version')!r}; this parlab reads {VERSION}")
        known = {f.name for f in fields(Event)}
        events = []
        for number, line in enumerate(lines[1:], start=2):
            record = json.loads(line)
            if not isinstance(record, dict) or not {"rank", "kind", "start"} <= set(record) or set(record) - known:
                raise ValueError(f"{path}:{number}: not an event of format version {VERSION}")
            if record.get("group") is not None:
                record["group"] = tuple(record["group"])
            events.append(Event(**record))
        if len(events) != header.get("events"):
            raise ValueError(f"{path}: the header promises {header.get('events')} events, the file holds {len(events)}")
        return cls(events, int(header["world_size"]))
