"""The notation every pipeline schedule is written in: an `Action` (F, B, BI or BW of one micro-batch on one model
chunk), a `Schedule` (each rank's ordered list of actions, and where its stages live), and the unit costs of the
ideal timeline. The schedules themselves are in schedules.py (GPipe, 1F1B, interleaved, ZB-H1) and
schedules_v.py (ZB-V, DualPipeV); the executor that runs them on ranks is executor.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

SPAN_KIND = {"F": "forward", "B": "backward", "BI": "backward_input", "BW": "backward_weight"}
DEFAULT_COSTS = {"F": 1, "B": 2, "BI": 1, "BW": 1}  # unit costs of the ideal timeline: B = BI + BW = 2 F


def exact_costs(costs: dict | None = None) -> dict[str, Fraction]:
    """The cost of each op as an exact fraction: DEFAULT_COSTS, with `costs` (e.g. {"BW": 2}) overriding them."""
    return {op: Fraction(c) for op, c in {**DEFAULT_COSTS, **(costs or {})}.items()}


@dataclass(frozen=True)
class Action:
    """One thing a rank does: op ("F", "B", "BI" or "BW") of micro-batch `mb` on its model chunk `chunk`.

    The sends and receives are implied: an F on stage s > 0 first receives its input from stage s - 1, and an F
    on stage s < S - 1 sends its output to stage s + 1; a B (or BI) receives its output gradient from stage s + 1
    (except on the last stage, which starts from the loss) and sends its input gradient to stage s - 1.
    """

    op: str
    mb: int
    chunk: int = 0

    def label(self, v: int = 1) -> str:
        """ "F3" (micro-batch 3), or "F3c1" (micro-batch 3 on chunk 1) when ranks hold several chunks."""
        return f"{self.op}{self.mb}" + (f"c{self.chunk}" if v > 1 else "")


@dataclass
class Schedule:
    """What every rank does in one training step: actions[r] is rank r's ordered list.

    layout: where the stages live. "loop" (Megatron): chunk k of rank r is stage k p + r. "v" (ZB-V, DualPipeV;
    v = 2): chunk 0 of rank r is stage r, chunk 1 is stage 2p - 1 - r, so the stages go down the ranks and back up.
    """

    name: str
    p: int
    m: int
    v: int
    actions: list[list[Action]]
    layout: str = "loop"

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage of rank `rank`'s chunk `chunk`: k p + r (loop), or r and 2p - 1 - r (V)."""
        if self.layout == "v" and chunk == 1:
            return 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def rank_of(self, stage: int) -> int:
        """The pipeline rank (rank within the pipeline group) that holds virtual stage `stage`."""
        if self.layout == "v" and stage >= self.p:
            return 2 * self.p - 1 - stage
        return stage % self.p

    def __str__(self) -> str:
        width = max(len(a.label(self.v)) for acts in self.actions for a in acts) + 1
        lines = [f"{self.name}: p={self.p} stages, m={self.m} micro-batches, v={self.v} chunk(s) per rank"]
        for r, acts in enumerate(self.actions):
            lines.append(f"rank {r}: " + "".join(a.label(self.v).ljust(width) for a in acts).rstrip())
        return "\n".join(lines)
