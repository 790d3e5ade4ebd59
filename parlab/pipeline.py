"""Pipeline parallelism: the GPT's layers cut into stages, micro-batches flowing through them on a schedule.

Notation (as in the GPipe, Megatron-LM and zero-bubble papers):
    p   pipeline stages = ranks (the world size)
    m   micro-batches per step: the global batch [B, T] is cut into m micro-batches [B/m, T]
    v   virtual stages (model chunks) per rank, for the interleaved schedule; S = p * v stages in all
    F   forward of one micro-batch through one stage; B its backward; the zero-bubble schedule splits B into
        BI (gradient w.r.t. the stage's input, which the previous stage waits for) and BW (gradient w.r.t. the
        stage's weights, which nobody waits for)

Stage s holds a contiguous run of transformer blocks; stage 0 also holds the embeddings, the last stage the final
LayerNorm, the LM head and the loss. Virtual stage s lives on rank s % p (Megatron's interleaving: rank r holds
chunks k = 0..v-1, i.e. stages r, r + p, r + 2p, ...). A forward sends the activation [B/m, T, H] to the next
stage's rank; a backward sends the activation's gradient [B/m, T, H] to the previous stage's rank.

A schedule is plain data: for each rank, the ordered list of actions it runs (`Action("F", mb, chunk)`). The same
list is (1) printed, (2) simulated with unit costs to draw the ideal timeline and compute its bubble exactly
(`simulate`, with fractions), and (3) executed by one small executor (`run_step`) on real ranks, which receives
what each action needs, computes it inside a `comm.span`, and sends what it produced. The lesson's figures and
tables (timelines, the schedules side by side) are drawn from these in parlab/lessons/pipeline.py.

Bubble: the fraction of a step a rank sits idle, averaged over ranks. With F and B costs t_f, t_b:
    GPipe, 1F1B        (p-1) / (m + p - 1)           each rank idles (p-1)(t_f + t_b) out of (m + p - 1)(t_f + t_b)
    interleaved        (p-1) / (v m + p - 1)         the fill and drain are v times shorter: stages are v x thinner
    zero bubble (H1)   (p-1)(t_f + t_bi - t_bw) / (m (t_f + t_bi + t_bw) + (p-1)(t_f + t_bi - t_bw))
                                                     the weight-gradient passes fill the 1F1B drain
"""

from __future__ import annotations

import argparse
from collections import Counter, deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn as nn

from parlab import comm
from parlab.check import check_equal, compare
from parlab.launch import Results, device
from parlab.models import GPT, GPTConfig, build_model, lm_loss, make_batches, make_optimizer, train_single_device
from parlab.schemes import Scheme, launch_scheme
from parlab.trace import Event, Trace

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "BI", "BW"
SPAN_KIND = {"F": "forward", "B": "backward", "BI": "backward_input", "BW": "backward_weight"}
DEFAULT_COSTS = {"F": 1, "B": 2, "BI": 1, "BW": 1}  # unit costs of the ideal timeline: B = BI + BW = 2 F


def exact_costs(costs: dict | None = None) -> dict[str, Fraction]:
    """The cost of each op as an exact fraction: DEFAULT_COSTS, with `costs` (e.g. {"BW": 2}) overriding them."""
    return {op: Fraction(c) for op, c in {**DEFAULT_COSTS, **(costs or {})}.items()}


# ------------------------------------------------------------------------------------ partitioning the model


def split_layers(layers: int, stages: int, split: Sequence[int] | None = None) -> list[range]:
    """The blocks each stage holds: stage s runs blocks ranges[s]. Even by default, or `split` blocks per stage.

    layers=8, stages=4 -> [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    """
    if split is None:
        if layers % stages:
            raise ValueError(f"layers={layers} is not divisible by stages={stages} (p x v); give an explicit split")
        split = [layers // stages] * stages
    split = list(split)
    if len(split) != stages:
        raise ValueError(f"split {split} has {len(split)} entries, but there are {stages} stages (p x v)")
    if sum(split) != layers:
        raise ValueError(f"split {split} adds up to {sum(split)} blocks, but the model has layers={layers}")
    if min(split) < 0:
        raise ValueError(f"split {split} has a negative entry")
    starts = [sum(split[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, split, strict=True)]


class Stage(nn.Module):
    """One pipeline stage: blocks `layers` of the reference GPT (its very modules, so names and values match).

    Stage 0 also embeds: input idx [b, T] (token ids) -> [b, T, H]. Other stages take [b, T, H].
    The last stage also applies ln_f and lm_head: output logits [b, T, V]. Other stages output [b, T, H].
    """

    def __init__(self, model: GPT, index: int, num_stages: int, layers: range):
        super().__init__()
        self.index, self.first, self.last, self.layers = index, index == 0, index == num_stages - 1, layers
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        self.embedding = nn.ModuleDict({"wte": model.wte, "wpe": model.wpe}) if self.first else None
        self.output = nn.ModuleDict({"ln_f": model.ln_f, "lm_head": model.lm_head}) if self.last else None
        # The reference model's names of the parameters held here ("blocks.3.mlp.fc.weight", "wte.weight", ...).
        prefixes = tuple(f"blocks.{i}." for i in layers)
        prefixes += ("wte.", "wpe.") if self.first else ()
        prefixes += ("ln_f.", "lm_head.") if self.last else ()
        self.named = {name: p for name, p in model.named_parameters() if name.startswith(prefixes)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # [b, T] token ids -> [b, T, H]
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embedding["wte"](x) + self.embedding["wpe"](positions)
        for block in self.blocks:
            x = block(x)  # [b, T, H]
        if self.last:
            x = self.output["lm_head"](self.output["ln_f"](x))  # [b, T, V]
        return x


# -------------------------------------------------------------------------------------- schedules, as data


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
    """What every rank does in one training step: actions[r] is rank r's ordered list."""

    name: str
    p: int
    m: int
    v: int
    actions: list[list[Action]]

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage of rank `rank`'s chunk `chunk`: chunk k of rank r is stage k p + r (Megatron)."""
        return chunk * self.p + rank

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def chunk_of(self, stage: int) -> int:
        return stage // self.p

    def __str__(self) -> str:
        width = max(len(a.label(self.v)) for acts in self.actions for a in acts) + 1
        lines = [f"{self.name}: p={self.p} stages, m={self.m} micro-batches, v={self.v} chunk(s) per rank"]
        for r, acts in enumerate(self.actions):
            lines.append(f"rank {r}: " + "".join(a.label(self.v).ljust(width) for a in acts).rstrip())
        return "\n".join(lines)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every rank runs all m forwards, then all m backwards.

    Naive model parallelism is GPipe with m = 1: one stage busy at a time.
    """
    actions = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    return Schedule("gpipe", p, m, 1, actions)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush, Narayanan et al. 2021): warm up with p - 1 - r forwards, then alternate one forward
    and one backward, then cool down with the remaining backwards.

    Rank r warms up with w_r = p - 1 - r forwards: the number of micro-batches that must still enter the stages
    below it before the first gradient can come back. The last rank (w = 0) runs F0 B0 F1 B1 ... straight away.
    A rank then holds at most w_r + 1 <= p micro-batches of activations, instead of GPipe's m.
    """
    forwards, backwards = [Action("F", i) for i in range(m)], [Action("B", i) for i in range(m)]
    return Schedule("1f1b", p, m, 1, [warmup_steady_cooldown(forwards, backwards, p - 1 - r) for r in range(p)])


def warmup_steady_cooldown(forwards: list[Action], backwards: list[Action], w: int) -> list[Action]:
    """The 1F1B order of one rank: its first w forwards (warm-up), then pairs of its next forward and its oldest
    backward (steady state), then the backwards still owed (cool-down)."""
    w = min(w, len(forwards))
    steady = [a for pair in zip(forwards[w:], backwards, strict=False) for a in pair]
    return forwards[:w] + steady + backwards[len(forwards) - w :]


def interleaved_order(j: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's j-th forward (or backward) in the interleaved schedule.

    Micro-batches go through the chunks in groups of p: forwards run mb 0..p-1 on chunk 0, then mb 0..p-1 on
    chunk 1, ..., then mb p..2p-1 on chunk 0, ...; backwards run the chunks in the reverse order.
    """
    group, within = divmod(j, p * v)
    chunk = within // p
    return group * p + within % p, (v - 1 - chunk) if backward else chunk


def interleaved_warmup(p: int, m: int, v: int, rank: int, megatron: bool = False) -> int:
    """Forwards rank `rank` runs before its first backward in the interleaved schedule.

    (v - 1) p: micro-batches travel in groups of p, so the first p micro-batches go through chunks 0..v-2 of this
    rank before micro-batch 0 comes back to its last chunk at all;
    + (p - 1 - r): then, as in 1F1B, the forwards still needed below this rank before the first gradient returns.

    Megatron-LM warms up with 2 (p - 1 - r) + (v - 1) N instead (megatron/core/pipeline_parallel/schedules.py, the
    count forward_backward_pipelining_with_interleaving uses; N is its micro-batch group size, a setting between p
    and m, p by default; capped at m v). Its comment explains the (v - 1) N term and says earlier ranks run more
    forwards, not why twice p - 1 - r. Our reading, from its executor: a steady iteration runs one F and one B and
    only then swaps, in one exchange, what they produced for what the next iteration needs. So a gradient on its way
    back waits at every hop for the end of the iteration that made it: one more iteration per hop than in Megatron's
    plain 1F1B, which exchanges after the F and again after the B (and warms up with p - 1 - r). Our executor sends
    asynchronously and starts each action as soon as its input is there; the ideal timelines show the smaller count
    reaches the same bubble with fewer activations held.
    megatron=True gives Megatron's count with N = p.
    """
    extra = 2 * (p - 1 - rank) if megatron else p - 1 - rank
    return min((v - 1) * p + extra, m * v)


def interleaved_1f1b(p: int, m: int, v: int, megatron_warmup: bool = False) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): each rank holds v chunks of layers; a 1F1B over m v passes.

    Requires m to be a multiple of p (micro-batches travel in groups of p).
    """
    forwards = [Action("F", *interleaved_order(j, p, v, backward=False)) for j in range(m * v)]
    backwards = [Action("B", *interleaved_order(j, p, v, backward=True)) for j in range(m * v)]
    actions = [
        warmup_steady_cooldown(forwards, backwards, interleaved_warmup(p, m, v, r, megatron_warmup)) for r in range(p)
    ]
    return Schedule("interleaved", p, m, v, actions)


def zero_bubble_h1(p: int, m: int, costs: dict | None = None) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al. 2024): 1F1B with the backward split into BI (input grad) and BW (weight grad).

    The F and BI passes run in exactly 1F1B's order (the previous stage waits only for BI). BW waits for nobody,
    so it is postponed: whenever a rank's next F or BI cannot start yet (its input has not arrived), or the next F
    would make it hold more than p micro-batches (1F1B's peak memory: the "H1"), the rank runs its oldest pending
    BW instead of idling. Where those gaps fall depends on the costs, so the order is found by placing the
    actions in time with the unit costs (default F = BI = BW = 1); the result is a plain action list like the others.
    """
    cost = exact_costs(costs)
    todo = [deque(Action("BI" if a.op == "B" else "F", a.mb) for a in acts) for acts in one_f_one_b(p, m).actions]
    schedule = Schedule("zb", p, m, 1, [[] for _ in range(p)])
    end: dict[tuple[str, int, int], Fraction] = {}  # (op, mb, stage) -> when it finished ("G": when BI did)
    free = [Fraction(0)] * p  # when each rank is free again
    pending: list[deque[int]] = [deque() for _ in range(p)]  # micro-batches whose BW is postponed
    inflight = [0] * p  # micro-batches whose F has run and whose BW has not
    blocked: set[int] = set()  # ranks that wait for an action of another rank that is not placed yet

    def run(r: int, a: Action, start: Fraction) -> None:
        schedule.actions[r].append(a)
        free[r] = end[(a.op, a.mb, r)] = start + cost[a.op]
        if a.op == "BI":
            end[("G", a.mb, r)] = free[r]
            pending[r].append(a.mb)
        inflight[r] += 1 if a.op == "F" else -1 if a.op == "BW" else 0
        blocked.clear()  # something new has happened: every rank may look again

    while any(todo[r] or pending[r] for r in range(p)):
        candidates = [r for r in range(p) if r not in blocked and (todo[r] or pending[r])]
        if not candidates:
            raise ScheduleError("zero-bubble placement deadlocked")
        r = min(candidates, key=lambda q: (free[q], q))  # the rank that is free earliest decides next
        a = todo[r][0] if todo[r] else None  # its next F or BI
        deps = dependencies(schedule, r, a) if a is not None else []
        ready = max((end[d] for d in deps), default=Fraction(0)) if a and all(d in end for d in deps) else None
        room = a is not None and (a.op != "F" or inflight[r] < p)  # an F must not make it hold more than p
        if ready is not None and room and ready <= free[r]:  # the next F or BI can start now
            run(r, todo[r].popleft(), free[r])
        elif pending[r]:  # the next F/BI would wait (or exceed p in flight): fill the gap with a postponed BW
            run(r, Action("BW", pending[r].popleft()), free[r])
        elif ready is not None and room:  # nothing to fill the gap with: wait for the input
            run(r, todo[r].popleft(), ready)
        else:
            blocked.add(r)
    return schedule


def make_schedule(
    name: str, p: int, m: int, v: int = 1, costs: dict | None = None, megatron_warmup: bool = False
) -> Schedule:
    """The schedule `name` (one of SCHEDULES) for p ranks and m micro-batches (v chunks per rank: interleaved).

    costs: only the zero-bubble schedule depends on them (where its postponed BW passes go).
    """
    check_schedule_args(name, p, m, v)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v, megatron_warmup)
    return zero_bubble_h1(p, m, costs)


def check_schedule_args(name: str, p: int, m: int, v: int = 1) -> None:
    """Reject what a schedule cannot run, with the reason."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}")
    if p < 1:
        raise ValueError(f"stages p={p} must be >= 1")
    if m < 1:
        raise ValueError(f"microbatches m={m} must be >= 1")
    if v < 1:
        raise ValueError(f"virtual stages v={v} must be >= 1")
    if name != "interleaved" and v != 1:
        raise ValueError(f"virtual stages (v={v}) apply only to the interleaved schedule, not {name!r}")
    if name in ("1f1b", "interleaved", "zb") and m < p:
        raise ValueError(
            f"schedule {name!r} needs microbatches >= stages: m={m} < p={p} never reaches the steady 1F1B phase "
            "(use gpipe, or more micro-batches)"
        )
    if name == "interleaved" and m % p:
        raise ValueError(f"schedule 'interleaved' needs microbatches to be a multiple of stages: m={m}, p={p}")


# ------------------------------------------------------------------------ checking and simulating a schedule


class ScheduleError(ValueError):
    """A schedule that is incomplete, would deadlock, or would mix up its messages."""


def _key(schedule: Schedule, rank: int, a: Action) -> tuple[str, int, int]:
    return (a.op, a.mb, schedule.stage(rank, a.chunk))


def dependencies(schedule: Schedule, rank: int, a: Action) -> list[tuple[str, int, int]]:
    """What must have finished before action `a` of rank `rank` can start, as (op, mb, stage) keys.

    ("G", mb, s) means "the gradient w.r.t. stage s's input is ready": the end of B or BI of (mb, s).
    """
    s, last = schedule.stage(rank, a.chunk), schedule.num_stages - 1
    if a.op == "F":
        return [("F", a.mb, s - 1)] if s > 0 else []
    if a.op in ("B", "BI"):
        return [("F", a.mb, s)] + ([("G", a.mb, s + 1)] if s < last else [])
    if a.op == "BW":
        return [("BI", a.mb, s)]
    raise ScheduleError(f"unknown op {a.op!r} in {a}")


@dataclass(frozen=True)
class Timed:
    """One action of the ideal timeline: rank, action, start and end in cost units (exact fractions)."""

    rank: int
    action: Action
    start: Fraction
    end: Fraction


def check_complete(schedule: Schedule) -> None:
    """Every rank runs, for each micro-batch and each of its chunks, exactly one F and one B (or one BI + one BW)."""
    for r, acts in enumerate(schedule.actions):
        seen = [(a.op, a.mb, a.chunk) for a in acts]
        for a in acts:
            if a.op not in SPAN_KIND or not (0 <= a.mb < schedule.m) or not (0 <= a.chunk < schedule.v):
                raise ScheduleError(f"rank {r}: action {a} is out of range (m={schedule.m}, v={schedule.v})")
        if len(set(seen)) != len(seen):
            raise ScheduleError(f"rank {r} runs an action twice")
        for mb in range(schedule.m):
            for k in range(schedule.v):
                has_b = ("B", mb, k) in seen
                has_split = ("BI", mb, k) in seen and ("BW", mb, k) in seen
                if ("F", mb, k) not in seen or has_b == has_split:
                    raise ScheduleError(f"rank {r}: micro-batch {mb} chunk {k} needs one F and one B (or BI + BW)")


def simulate(schedule: Schedule, costs: dict | None = None) -> list[Timed]:
    """The ideal timeline: each rank runs its actions in order, each as soon as the rank is free and its inputs
    have arrived (communication is free). Times are exact fractions of the costs (default DEFAULT_COSTS).

    Raises ScheduleError if some rank waits for something that never happens (a deadlock).
    """
    costs = exact_costs(costs)
    done: dict[tuple[str, int, int], Fraction] = {}
    position, free = [0] * schedule.p, [Fraction(0)] * schedule.p
    timeline: list[Timed] = []
    while True:
        moved = False
        for r, acts in enumerate(schedule.actions):
            while position[r] < len(acts):
                a = acts[position[r]]
                deps = dependencies(schedule, r, a)
                if any(d not in done for d in deps):
                    break  # this rank waits; the others may unblock it
                start = max([free[r]] + [done[d] for d in deps])
                end = start + costs[a.op]
                timeline.append(Timed(r, a, start, end))
                op, mb, s = _key(schedule, r, a)
                done[(op, mb, s)] = end
                if op in ("B", "BI"):
                    done[("G", mb, s)] = end
                free[r], position[r] = end, position[r] + 1
                moved = True
        if all(position[r] == len(acts) for r, acts in enumerate(schedule.actions)):
            return timeline
        if not moved:
            stuck = [
                f"rank {r} at {acts[position[r]].label(schedule.v)}"
                for r, acts in enumerate(schedule.actions)
                if position[r] < len(acts)
            ]
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + ", ".join(stuck))


def messages(schedule: Schedule) -> dict[tuple[int, int, str], tuple[list, list]]:
    """For each channel (src, dst, "act" or "grad"): the messages in the order src sends them and in the order
    dst receives them, each named (mb, receiving stage)."""
    channels: dict[tuple[int, int, str], tuple[list, list]] = {}
    last = schedule.num_stages - 1
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            s = schedule.stage(r, a.chunk)
            if a.op == "F" and s < last:  # sends its output to s + 1
                channels.setdefault((r, schedule.rank_of(s + 1), "act"), ([], []))[0].append((a.mb, s + 1))
            if a.op == "F" and s > 0:  # receives its input from s - 1
                channels.setdefault((schedule.rank_of(s - 1), r, "act"), ([], []))[1].append((a.mb, s))
            if a.op in ("B", "BI") and s > 0:  # sends its input gradient to s - 1
                channels.setdefault((r, schedule.rank_of(s - 1), "grad"), ([], []))[0].append((a.mb, s - 1))
            if a.op in ("B", "BI") and s < last:  # receives its output gradient from s + 1
                channels.setdefault((schedule.rank_of(s + 1), r, "grad"), ([], []))[1].append((a.mb, s))
    return channels


def validate(schedule: Schedule) -> list[Timed]:
    """Check that a schedule can run on real ranks; return its ideal timeline.

    - complete: every rank runs each (micro-batch, chunk) forward and backward exactly once;
    - deadlock-free: simulated with the dependencies, every action eventually runs;
    - in order: on each channel the receiver posts its receives in the order the sender sends. send/recv
      messages between two ranks are matched in posting order, so a mismatch would hand micro-batch 3's
      activation to micro-batch 4, silently. (Activations and gradients travel on separate process groups.)
    """
    check_complete(schedule)
    timeline = simulate(schedule)
    for (src, dst, kind), (sent, received) in messages(schedule).items():
        if sent != received:
            raise ScheduleError(
                f"rank {dst} receives {kind} messages from rank {src} in the order {received}, "
                f"but rank {src} sends them in the order {sent}"
            )
    return timeline


def bubble(timeline: Sequence[Timed], p: int) -> Fraction:
    """Idle fraction of the ideal timeline: sum over ranks of (makespan - busy), over p x makespan."""
    makespan = max(t.end for t in timeline) - min(t.start for t in timeline)
    busy = sum((t.end - t.start for t in timeline), Fraction(0))
    return 1 - busy / (p * makespan)


def bubble_formula(name: str, p: int, m: int, v: int = 1, costs: dict | None = None) -> tuple[Fraction, str]:
    """The textbook bubble fraction of a schedule, exactly, and the formula as text."""
    c = exact_costs(costs)
    if name in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1), "(p-1)/(m+p-1)"
    if name == "interleaved":
        return Fraction(p - 1, v * m + p - 1), "(p-1)/(v*m+p-1)"
    idle = (p - 1) * (c["F"] + c["BI"] - c["BW"])
    return idle / (m * (c["F"] + c["BI"] + c["BW"]) + idle), "(p-1)(F+BI-BW)/(m(F+BI+BW)+(p-1)(F+BI-BW))"


def phases(schedule: Schedule) -> list[dict[str, dict[str, int]]]:
    """Per rank, how many actions of each op fall in the warm-up, the steady (1F1B) phase and the cool-down.

    The steady phase runs from the forward just before the first backward to the backward just after the last
    forward; warm-up and cool-down are what lies outside it. 1F1B, rank r: warm-up p-1-r F, steady m-(p-1-r)
    F and as many B, cool-down p-1-r B. GPipe: warm-up m-1 F, steady F B, cool-down m-1 B.
    """
    rows = []
    for acts in schedule.actions:
        first_b = next(i for i, a in enumerate(acts) if a.op != "F")
        last_f = max(i for i, a in enumerate(acts) if a.op == "F")
        parts = {
            "warmup": acts[: first_b - 1],
            "steady": acts[first_b - 1 : last_f + 2],
            "cooldown": acts[last_f + 2 :],
        }
        rows.append({name: dict(Counter(a.op for a in part)) for name, part in parts.items()})
    return rows


def phase_lines(schedule: Schedule) -> list[str]:
    """phases() as one printable line per rank: "rank 0: warm-up 3 F | steady 5 F + 5 B | cool-down 3 B"."""

    def text(counts: dict[str, int]) -> str:
        return " + ".join(f"{n} {op}" for op, n in counts.items()) or "none"

    return [
        f"rank {r}: warm-up {text(ph['warmup'])} | steady {text(ph['steady'])} | cool-down {text(ph['cooldown'])}"
        for r, ph in enumerate(phases(schedule))
    ]


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per rank, from the schedule alone: the most (micro-batch, chunk) activations held at once (held from the
    F until the last backward action of that micro-batch: B, or BW)."""
    peaks = []
    for acts in schedule.actions:
        held, peak = 0, 0
        for a in acts:
            held += 1 if a.op == "F" else -1 if a.op in ("B", "BW") else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


# ---------------------------------------------------------------------------------------------- the executor


@dataclass
class InFlight:
    """What a rank holds for one (micro-batch, chunk) between its F and its last backward action."""

    inp: torch.Tensor  # the stage input: [b, T] token ids on stage 0, else the received activation [b, T, H]
    out: torch.Tensor  # the stage output [b, T, H] (sent on), or on the last stage the scaled loss (a scalar)
    saved_bytes: int  # bytes of the activations autograd saved for the backward (measured in the forward)
    module_outputs: list = field(default_factory=list)  # zero bubble: (output, its module's weights) per module
    output_grads: tuple = ()  # zero bubble: d loss / d output of each of those modules, from BI, for BW


@contextmanager
def count_saved_bytes(exclude: set[int]):
    """Measure the activations autograd saves for the backward inside the block: yields a one-item list that
    ends up holding their bytes. Each storage counts once; storages in `exclude` (the weights) not at all."""
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and ptr not in exclude:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


@dataclass
class StepStats:
    peak_inflight: int = 0  # most (micro-batch, chunk) activation sets held at once
    peak_activation_bytes: int = 0  # most bytes of saved activations held at once
    loss: float = 0.0  # sum over micro-batches of loss_i / m = the global batch's mean loss (last stage only)


def run_step(
    schedule: Schedule,
    stages: dict[int, Stage],
    cfg: GPTConfig,
    x: torch.Tensor,
    y: torch.Tensor,
    step: int,
    grad_group=None,
) -> StepStats:
    """Run one training step's forwards and backwards on this rank, in the order schedule.actions[rank] says.

    stages: this rank's stages, by chunk (its chunk k is stage k p + rank).
    x, y: the global batch [B, T]; micro-batch i is rows [i B/m, (i+1) B/m).
    Gradients accumulate in the stages' .grad over the m micro-batches (each loss is scaled by 1/m, so they sum to
    the global batch's mean-loss gradient). Activations travel on the default group, their gradients on
    `grad_group`, so the two kinds never queue behind each other between the same two ranks.
    """
    rank, m, last = dist.get_rank(), schedule.m, schedule.num_stages - 1
    xs, ys = x.chunk(m), y.chunk(m)  # m micro-batches of [b, T], b = B/m
    b, T = xs[0].shape
    weights = {w.untyped_storage().data_ptr() for stage in stages.values() for w in stage.parameters()}
    held: dict[tuple[int, int], InFlight] = {}
    sends = []  # asynchronous sends, waited for at the end of the step
    stats = StepStats()
    split_backward = any(a.op == "BI" for a in schedule.actions[rank])

    for a in schedule.actions[rank]:
        s = schedule.stage(rank, a.chunk)
        stage, tag = stages[a.chunk], f"{a.label(schedule.v)}"
        if a.op == "F":
            if s == 0:
                inp = xs[a.mb]  # [b, T] token ids
            else:  # receive the activation of stage s-1: [b, T, H]
                inp = torch.empty(b, T, cfg.hidden, dtype=cfg.torch_dtype, device=x.device)
                comm.recv(inp, src=schedule.rank_of(s - 1), label=tag)
                inp.requires_grad_()
            captured: list = []
            hooks = _capture_module_outputs(stage, captured) if split_backward else []
            with comm.span(tag, kind="forward", mb=a.mb, chunk=a.chunk, step=step), count_saved_bytes(weights) as nb:
                out = stage(inp)  # [b, T, H], or logits [b, T, V] on the last stage
                if s == last:
                    out = lm_loss(out, ys[a.mb]) / m  # scaled: the m losses add up to the global mean
            for h in hooks:
                h.remove()
            if s == last:
                stats.loss += out.item()
            else:  # send the activation on to stage s+1
                sends.append(comm.isend(out.detach(), dst=schedule.rank_of(s + 1), label=tag))
            held[(a.mb, a.chunk)] = InFlight(inp, out, nb[0], captured)
            stats.peak_inflight = max(stats.peak_inflight, len(held))
            stats.peak_activation_bytes = max(stats.peak_activation_bytes, sum(h.saved_bytes for h in held.values()))
            continue

        entry = held[(a.mb, a.chunk)]
        if a.op in ("B", "BI"):
            if s == last:
                grad = None  # the loss itself starts the backward
            else:  # receive d loss / d output from stage s+1: [b, T, H]
                grad = torch.empty_like(entry.out)
                comm.recv(grad, src=schedule.rank_of(s + 1), group=grad_group, label=tag)
            with comm.span(tag, kind=SPAN_KIND[a.op], mb=a.mb, chunk=a.chunk, step=step):
                if a.op == "B":  # the whole backward: input gradient and weight gradients (into .grad)
                    torch.autograd.backward(entry.out, grad)
                    input_grad = entry.inp.grad if s > 0 else None
                else:  # BI: only the gradients w.r.t. the stage input and w.r.t. each module's output
                    targets = ([entry.inp] if s > 0 else []) + [o for o, _ in entry.module_outputs]
                    grads = torch.autograd.grad(entry.out, targets, grad, retain_graph=True)
                    input_grad = grads[0] if s > 0 else None
                    entry.output_grads = grads[1:] if s > 0 else grads
            if s > 0:  # send d loss / d input back to stage s-1
                sends.append(comm.isend(input_grad, dst=schedule.rank_of(s - 1), group=grad_group, label=tag))
            if a.op == "B":
                del held[(a.mb, a.chunk)]
        elif a.op == "BW":
            with comm.span(tag, kind="backward_weight", mb=a.mb, chunk=a.chunk, step=step):
                # d loss / d W of each module from d loss / d (its output): touches only that module's weights
                for (output, params), g in zip(entry.module_outputs, entry.output_grads, strict=True):
                    torch.autograd.backward(output, g, inputs=params)
            del held[(a.mb, a.chunk)]
    comm.wait_all(sends)
    return stats


def _capture_module_outputs(stage: Stage, captured: list) -> list:
    """Zero bubble: record the output of every module that owns weights (Linear, LayerNorm, Embedding) during the
    forward, with those weights, so BW can later turn d loss / d output into d loss / d weights."""

    def hook(module, _inputs, output):
        captured.append((output, list(module.parameters(recurse=False))))

    return [
        module.register_forward_hook(hook)
        for module in stage.modules()
        if any(True for _ in module.parameters(recurse=False))
    ]


# ------------------------------------------------------------------------------------------ the training run


def model_config(opts: dict) -> GPTConfig:
    """The reference GPT of a pipeline run: tiny, with `layers` blocks to share out among the p v stages."""
    return GPTConfig(layers=opts["layers"], hidden=opts.get("hidden", 32), dtype=opts["dtype"])


def virtual_stages(opts: dict) -> int:
    """v: --virtual if given, else 2 for the interleaved schedule and 1 for the others."""
    if opts.get("virtual") is not None:
        return opts["virtual"]
    return 2 if opts["schedule"] == "interleaved" else 1


def schedule_for(opts: dict) -> Schedule:
    costs = opts.get("costs")
    return make_schedule(
        opts["schedule"], opts["world"], opts["microbatches"], virtual_stages(opts), costs, opts.get("megatron_warmup")
    )


def check_options(opts: dict) -> None:
    """Reject bad options with a clear ValueError before any process starts."""
    p, m, v = opts["world"], opts["microbatches"], virtual_stages(opts)
    check_schedule_args(opts["schedule"], p, m, v)
    if opts["steps"] < 1:
        raise ValueError(f"steps={opts['steps']} must be >= 1")
    if opts["batch"] % m:
        raise ValueError(f"batch={opts['batch']} is not divisible by microbatches={m}")
    split = opts.get("split")
    if split is None and opts["layers"] % (p * v):
        base, extra = divmod(opts["layers"], p * v)
        example = ",".join(str(base + (s < extra)) for s in range(p * v))
        raise ValueError(
            f"layers={opts['layers']} is not divisible by stages x virtual = {p} x {v} = {p * v} "
            f"(give an explicit split of the blocks, e.g. --split {example})"
        )
    split_layers(opts["layers"], p * v, split)
    model_config(opts)  # dtype, hidden
    validate(schedule_for(opts))  # complete, deadlock-free, messages in order: before any rank runs it


def pipeline_rank(opts: dict) -> dict:
    """Rank code: build this rank's stages, train `steps` steps with the schedule, return what the check needs.

    Every rank builds the whole reference model from the seed (it is tiny) and keeps only its own stages.
    """
    cfg, schedule, rank = model_config(opts), schedule_for(opts), dist.get_rank()
    model = build_model(cfg, opts["seed"]).to(device())  # this rank's GPU under NCCL, else the CPU
    layer_ranges = split_layers(cfg.layers, schedule.num_stages, opts.get("split"))
    stages = {}
    for k in range(schedule.v):  # rank r holds chunks k = 0..v-1: stages r, r + p, ...
        s = schedule.stage(rank, k)
        stages[k] = Stage(model, s, schedule.num_stages, layer_ranges[s])
    del model  # what this rank does not hold goes away
    named = {name: w for stage in stages.values() for name, w in stage.named.items()}
    optimizer = make_optimizer(list(named.values()), "sgd", opts["lr"])
    grad_group = dist.new_group(list(range(schedule.p)))  # activation gradients get a channel of their own

    losses, first_grads, stats = [], {}, []
    for step, (x, y) in enumerate(make_batches(cfg, opts["batch"], opts["steps"], opts["seed"])):
        optimizer.zero_grad(set_to_none=True)
        stats.append(run_step(schedule, stages, cfg, x.to(device()), y.to(device()), step, grad_group))
        if step == 0:
            first_grads = {name: w.grad.detach().clone() for name, w in named.items()}
        with comm.span("SGD", kind="optimizer", step=step):
            optimizer.step()
        losses.append(stats[-1].loss)
    holds_last = schedule.rank_of(schedule.num_stages - 1) == rank
    return {
        "losses": losses if holds_last else None,
        "grads": first_grads,
        "params": {name: w.detach().clone() for name, w in named.items()},
        "peak_inflight": max(s.peak_inflight for s in stats),
        "peak_activation_bytes": max(s.peak_activation_bytes for s in stats),
    }


def theory_send_bytes(schedule: Schedule, opts: dict) -> list[int]:
    """Bytes each rank sends per run: one [b, T, H] activation per F not on the last stage, one [b, T, H]
    gradient per B (or BI) not on stage 0, for each step."""
    cfg = model_config(opts)
    b = opts["batch"] // schedule.m
    message = b * cfg.seq_len * cfg.hidden * torch.empty(0, dtype=cfg.torch_dtype).element_size()
    sends = [0] * schedule.p
    for (src, _dst, _kind), (sent, _received) in messages(schedule).items():
        sends[src] += len(sent)
    return [n * message * opts["steps"] for n in sends]


def step_spans(trace: Trace, step: int | None = None) -> list[Event]:
    """The compute spans (F, B, BI, BW; not the optimizer) the ranks recorded in one step (default: the last)."""
    spans = [e for e in trace.events if e.kind in SPAN_KIND.values()]
    if step is None:
        step = max(e.extra.get("step", 0) for e in spans)
    return [e for e in spans if e.extra.get("step") == step]


def measured_bubble(trace: Trace, step: int | None = None) -> tuple[float, list[float]]:
    """Idle fraction of the ranks' compute in one step (default: the last), from their recorded spans.

    T = from the step's first span's start to its last span's end over all ranks; rank r's bubble = (T - its busy
    time) / T; returns the mean over ranks and the per-rank list.
    """
    spans = step_spans(trace, step)
    t0, t1 = min(e.start for e in spans), max(e.end for e in spans)
    per_rank = [1 - sum(e.duration for e in spans if e.rank == r) / (t1 - t0) for r in range(trace.world_size)]
    return sum(per_rank) / len(per_rank), per_rank


def pipeline_report(opts: dict, results: Results) -> dict:
    """Parent side: the single-device reference, the comparison, the bubble (ideal, formula, measured), memory."""
    cfg, schedule = model_config(opts), schedule_for(opts)
    p, m, v = schedule.p, schedule.m, schedule.v
    batches = make_batches(cfg, opts["batch"], opts["steps"], opts["seed"])
    reference = train_single_device(cfg, batches, opts["seed"])
    grads = {name: g for r in results for name, g in r["grads"].items()}
    params = {name: w for r in results for name, w in r["params"].items()}
    losses = results[schedule.rank_of(schedule.num_stages - 1)]["losses"]
    verdicts = [
        compare(
            f"loss of each of {opts['steps']} steps",
            torch.tensor(losses, dtype=cfg.torch_dtype),  # the float32 run is compared with float32's tolerance
            torch.tensor(reference.losses, dtype=cfg.torch_dtype),
            show=False,
        ),
        compare("gradients after step 1 (all stages)", grads, reference.grads, show=False),
        compare(f"parameters after {opts['steps']} SGD steps", params, reference.params, show=False),
    ]
    sent = results.trace.bytes_per_rank().get("send", [0] * p)
    theory = theory_send_bytes(schedule, opts)
    counts = [check_equal(f"bytes sent by rank {r}", sent[r], theory[r], show=False) for r in range(p)]
    ideal = bubble(simulate(schedule, opts.get("costs")), p)
    formula, formula_text = bubble_formula(schedule.name, p, m, v, opts.get("costs"))
    measured, measured_per_rank = measured_bubble(results.trace)
    peaks = [r["peak_inflight"] for r in results]
    worst = max(verdicts, key=lambda x: x.max_abs_err)
    exact = check_equal("ideal bubble = formula (exact fractions)", int(ideal == formula), 1, show=False)
    lines = [x.line for x in verdicts + counts + [exact]]
    lines.append(f"bubble: ideal {ideal} = {float(ideal):.4f}, formula {formula_text} = {formula}")
    lines.append(f"bubble measured (last step, mean over ranks): {measured:.3f}")
    lines.append(f"peak in-flight (micro-batch, chunk) activations per rank: {peaks}")
    lines += phase_lines(schedule)
    return {
        "scheme": "pp",
        "world_size": p,
        "passed": all(x.passed for x in verdicts + counts + [exact]),
        "max_abs_err": worst.max_abs_err,
        "tol": worst.tol,
        "comm": {**results.trace.bytes_per_rank(), "theory_send_bytes_per_rank": theory},
        "verdicts": lines,
        "schedule": schedule.name,
        "microbatches": m,
        "virtual": v,
        "layers_per_stage": [len(r) for r in split_layers(cfg.layers, p * v, opts.get("split"))],
        "bubble_ideal": float(ideal),
        "bubble_ideal_fraction": str(ideal),
        "bubble_formula": float(formula),
        "bubble_formula_fraction": str(formula),
        "bubble_formula_text": formula_text,
        "bubble_measured": measured,
        "bubble_measured_per_rank": measured_per_rank,
        "peak_inflight_microbatches": max(peaks),
        "peak_inflight_per_rank": peaks,
        "peak_inflight_ideal_per_rank": peak_inflight(schedule),
        "peak_activation_bytes_per_rank": [r["peak_activation_bytes"] for r in results],
        "phases": phases(schedule),
    }


def run_pipeline(schedule: str = "1f1b", world: int = 4, microbatches: int = 8, **opts) -> tuple[Results, dict]:
    """Run a pipeline schedule on live ranks; returns (results, report) like `python -m parlab run pp --json`.

    opts: virtual, layers, batch, split, lr, steps, seed, dtype, costs, megatron_warmup (see SCHEMES defaults).
    """
    return launch_scheme("pp", schedule=schedule, world=world, microbatches=microbatches, **opts)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", choices=SCHEDULES, default=DEFAULTS["schedule"])
    parser.add_argument("--microbatches", type=int, default=DEFAULTS["microbatches"], help="m, micro-batches per step")
    parser.add_argument("--virtual", type=int, default=None, help="v, chunks per rank (interleaved; default 2)")
    parser.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="transformer blocks in the model")
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="hidden size H (4 heads)")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="global batch size (sequences)")
    parser.add_argument(
        "--split", type=lambda s: [int(n) for n in s.split(",")], default=None, help="blocks per stage, e.g. 3,2,2,1"
    )
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--megatron-warmup", action="store_true", help="interleaved: Megatron-LM's warm-up count")


DEFAULTS = {
    "schedule": "1f1b",
    "microbatches": 8,
    "virtual": None,
    "layers": 8,
    "hidden": 32,
    "batch": 16,
    "split": None,
    "lr": 0.1,
    "megatron_warmup": False,
    "costs": None,
}

SCHEMES = [
    Scheme(
        name="pp",
        help="pipeline parallel: GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules, with their bubbles",
        rank_fn=pipeline_rank,
        report=pipeline_report,
        add_arguments=_add_arguments,
        check=check_options,
        defaults=DEFAULTS,
    )
]
