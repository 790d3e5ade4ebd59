"""V-shaped pipeline schedules: ZB-V (Qi et al. 2024) and DualPipeV (DeepSeek-AI 2024), as data.

Both give each rank two stages in a V: with S = 2p stages, rank r holds stage r (its chunk 0, on the way down)
and stage 2p - 1 - r (its chunk 1, on the way back up). Rank 0 holds the first and the last stage, so the loss
is computed where the input came in; rank p - 1 holds the two middle stages, and hands the activation of stage
p - 1 to stage p (and the gradient back) without sending anything. Schedule(layout="v") does this placement;
everything else (the checker, the simulator, the executor) is the same as for the classic schedules in
parlab/schemes/pipeline/schedules.py.

Each function builds its order the way torch 2.13's twin does (`ScheduleZBVZeroBubble`, `ScheduleDualPipeV` in
torch/distributed/pipelining/schedules.py), phase by phase, with counters of the next micro-batch of each
(op, chunk). tests/test_pipeline_v.py compares them action by action with torch's `pipeline_order` (p = 4,
m = 8, and more); the only difference is one of notation:

- torch lists DualPipeV's steady steps as OVERLAP_F_B actions, a forward and a full backward of two different
  micro-batches that a GPU runs at once (one's compute hides the other's communication, the point of DualPipe).
  Our executor runs one action at a time, so such a pair is its two sub-actions in torch's order (F, then B):
  the same computation, and on a device that cannot overlap (ours) the same timeline.
- torch pads ZB-V to 2p - 1 micro-batches and writes None where a padded one would be; those are left out here.

Bubbles: at unit costs (F = BI = BW = 1 per chunk, B = 2) both idle exactly (p - 1) F per rank: ZB-V only in
the skew of the fill and the drain, DualPipeV partly in single gaps of its second half. So
bubble = (p - 1) F / (2 m (F + BI + BW) + (p - 1) F), 1/17 at p = 4, m = 8 (zb: 1/9). `bubble_formula_v`
relates this to the zero-bubble paper's and DualPipe's formulas.
Peak activations: ZB-V holds 2p (micro-batch, chunk) sets = p whole stages, 1F1B's memory; DualPipeV 2p + 1
(DualPipe's "PP + 1").
"""

from __future__ import annotations

from collections import Counter, deque
from fractions import Fraction

from parlab.schemes.pipeline.actions import Action, Schedule, exact_costs


class _Orders:
    """One rank's action list being written: the next micro-batch of each (op, chunk) is counted for us.

    B and BI share a counter (both are "the backward of the next micro-batch"); BW is taken from the queue of
    micro-batches whose BI has run (oldest first), as a zero-bubble schedule postpones them.
    """

    def __init__(self, m: int):
        self.m, self.actions, self.next, self.pending_w = m, [], Counter(), deque()

    def add(self, op: str, chunk: int) -> None:
        counter = "B" if op in ("B", "BI") else op
        mb = self.next[(counter, chunk)]
        self.next[(counter, chunk)] += 1
        if mb < self.m:  # a padded micro-batch (ZB-V with m < 2p - 1) is not run
            self.actions.append(Action(op, mb, chunk))
        if op == "BI":
            self.pending_w.append((mb, chunk))

    def weight(self, chunk: int | None = None) -> None:
        """The postponed BW of the oldest BI (of `chunk`, or of either chunk), if there is one."""
        for i, (mb, c) in enumerate(self.pending_w):
            if chunk is None or c == chunk:
                del self.pending_w[i]
                if mb < self.m:
                    self.actions.append(Action("BW", mb, c))
                return


def check_v_args(name: str, p: int, m: int, v: int) -> None:
    """Reject what a V schedule cannot run (parlab.schemes.pipeline.schedules.check_schedule_args calls this), with the
    reason."""
    if v != 2:
        raise ValueError(
            f"schedule {name!r} needs exactly 2 stages per rank in a V (2p = {2 * p} stages, an even number): "
            f"v={v} gives {p * v} stages"
        )
    if name == "dualpipev" and m < 2 * p:
        raise ValueError(f"schedule 'dualpipev' needs microbatches >= 2 x stages: m={m} < 2p={2 * p}")


def zbv(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): two chunks per rank in a V, the
    backward split into BI and BW, peak activations those of 1F1B (2p chunk-sized sets = p whole stages).

    Rank r (chunk 0 = stage r, chunk 1 = stage 2p - 1 - r; n = max(m, 2p - 1) counting padded micro-batches):
      warm-up   2(p - r) - 1 forwards of chunk 0; r times F(chunk 1) F(chunk 0); p - r times F BI BW of chunk 1
                (the deepest stages turn round at once: their backward starts as soon as their forward ends)
      steady    while forwards remain: F BI BW of chunk 0 (no F once all n went in), then F BI BW of chunk 1
      cool-down r times BI(chunk 0) BI(chunk 1); p - r times BI(chunk 0) and the oldest BW of chunk 0; then the
                BW still owed, chunk 1 first (they wait for nobody: they fill the drain)
    """
    actions = []
    n = max(m, 2 * p - 1)
    for r in range(p):
        o = _Orders(m)
        for _ in range(2 * (p - r) - 1):
            o.add("F", 0)
        for _ in range(r):
            o.add("F", 1), o.add("F", 0)
        for _ in range(p - r):
            o.add("F", 1), o.add("BI", 1), o.weight(1)
        while o.next[("F", 1)] < o.next[("F", 0)] or o.next[("F", 0)] < n:
            if o.next[("F", 0)] < n:
                o.add("F", 0)
            o.add("BI", 0), o.weight(0)
            o.add("F", 1), o.add("BI", 1), o.weight(1)
        for _ in range(r):
            o.add("BI", 0), o.add("BI", 1)
        for _ in range(p - r):
            o.add("BI", 0), o.weight(0)
        while any(c == 1 for _, c in o.pending_w):
            o.weight(1)
        while o.pending_w:
            o.weight(0)
        actions.append(o.actions)
    return Schedule("zbv", p, m, 2, actions, layout="v")


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-AI 2024, DeepSeek-V3 report section 3.2.1; the V-shaped half of DualPipe): two chunks
    per rank in a V; in the steady state each step pairs one micro-batch's forward on one chunk with another's
    full backward on the other chunk (on a GPU the pair overlaps: the compute of one hides the all-to-all of the
    other); zero-bubble splits (BI, later BW) only where they fill the fill and the drain. Needs m >= 2p.

    Rank r (chunk 0 = stage r, chunk 1 = stage 2p - 1 - r), in eight steps:
      1  2(p - r - 1) forwards of chunk 0
      2  r + 1 times F(chunk 0) F(chunk 1)
      3  p - r - 1 times BI(chunk 1), a postponed BW, F(chunk 1)
      4  m - 2p + r + 1 times the pairs F(chunk 0)+B(chunk 1), F(chunk 1)+B(chunk 0)   (the overlapped steady state)
      5  p - r - 1 times B(chunk 1), F(chunk 1)+B(chunk 0)
      6  r + 1 times the backward of chunk 1 then of chunk 0: full B for the first half, BI (split) from the
         middle on (odd r switch one action earlier than even r)
      7  p - r - 1 times a postponed BW, the backward of chunk 0 (BI if step 6 switched, else B)
      8  r + 1 postponed BW
    """
    check_v_args("dualpipev", p, m, 2)
    actions = []
    for r in range(p):
        o = _Orders(m)
        for _ in range(2 * (p - r - 1)):
            o.add("F", 0)
        for _ in range(r + 1):
            o.add("F", 0), o.add("F", 1)
        for _ in range(p - r - 1):
            o.add("BI", 1), o.weight(), o.add("F", 1)
        for _ in range(m - 2 * p + r + 1):
            o.add("F", 0), o.add("B", 1)  # one overlapped pair in torch (F&B), two actions here
            o.add("F", 1), o.add("B", 0)
        for _ in range(p - r - 1):
            o.add("B", 1)
            o.add("F", 1), o.add("B", 0)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            o.add("BI" if split else "B", 1)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            o.add("BI" if split else "B", 0)
        for _ in range(p - r - 1):
            o.weight()
            o.add("BI" if split else "B", 0)
        for _ in range(r + 1):
            o.weight()
        actions.append(o.actions)
    return Schedule("dualpipev", p, m, 2, actions, layout="v")


def formula_holds(name: str, p: int, m: int, costs: dict | None = None) -> bool:
    """Where `bubble_formula_v` is the exact ideal bubble: unit costs (F = BI = BW, B = 2F), and for ZB-V enough
    micro-batches to fill the V (2m >= 3p - 1; checked by simulation for p <= 8; DualPipeV needs m >= 2p anyway)."""
    c = exact_costs(costs)
    unit = c["F"] == c["BI"] == c["BW"] and c["B"] == 2 * c["F"]
    return unit and (name != "zbv" or 2 * m >= 3 * p - 1)


def bubble_formula_v(name: str, p: int, m: int, costs: dict | None = None) -> tuple[Fraction, str]:
    """The ideal bubble of a V schedule in closed form, exactly, and the formula as text.

    Rank r idles r units F before its first forward (the input takes r chunk-forwards to reach it) and the rest
    of p - 1 at the end (ZB-V; DualPipeV has part of it as single gaps in its second half): (p - 1) F per
    rank, against 2 m (F + BI + BW) of work (m micro-batches through 2 chunks):

        bubble = (p - 1) F / (2 m (F + BI + BW) + (p - 1) F)            (exact where `formula_holds`)

    The papers' formulas count idle time per rank beside it:
      zero-bubble paper, ZB-V: (p - 1)(T_F + T_B - 2 T_W) with T_* the time of a whole stage's pass (two chunks
        here; T_B is the input-gradient pass BI): 0 when T_F = T_B = T_W. What is left, (p - 1) F, is the skew of
        the parallelogram each rank's work forms; the paper removes it across steps by not synchronising the
        optimizer step ("optimizer post-validation"); a step that ends with every rank at a barrier keeps it.
      DualPipe (DeepSeek-V3 report, table 2): (PP/2 - 1)(F&B + B - 3W), for DualPipe on PP ranks (two pipelines
        fed from both ends) where F&B, one micro-batch's forward overlapped with another's backward, costs less
        than F + B on a GPU. DualPipeV is DualPipe folded in half (PP/2 = p ranks); on a device that runs one
        thing at a time (F&B = F + B = 3, B = 2, W = 1) it gives 2 (p - 1): a bound written for the two-way
        DualPipe, not an exact count for this order, whose exact idle (simulated) is (p - 1) F, like ZB-V's.
    """
    c = exact_costs(costs)
    idle = (p - 1) * c["F"]
    return idle / (2 * m * (c["F"] + c["BI"] + c["BW"]) + idle), "(p-1)F/(2m(F+BI+BW)+(p-1)F)"


def paper_idle(name: str, p: int, costs: dict | None = None) -> tuple[Fraction, str]:
    """The idle time per rank (cost units) that the paper's formula gives, F&B = F + B: (value, formula)."""
    c = exact_costs(costs)
    if name == "zbv":
        return (p - 1) * (2 * c["F"] + 2 * c["BI"] - 4 * c["BW"]), "(p-1)(T_F+T_B-2T_W)"
    return (p - 1) * ((c["F"] + c["B"]) + c["B"] - 3 * c["BW"]), "(PP/2-1)(F&B+B-3W)"
