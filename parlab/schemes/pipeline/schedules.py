"""Pipeline schedules as data: which forward and backward each rank runs, in which order.

A schedule is plain data: for each pipeline rank, the ordered list of actions it runs (`Action("F", mb, chunk)`).
The same list is (1) printed, (2) simulated with unit costs to draw the ideal timeline and compute its bubble
exactly (`simulate`, with fractions), (3) checked (`validate`: complete, deadlock-free, messages in order), and
(4) executed on real ranks by parlab/schemes/pipeline/executor.py, which also holds the model's partition into stages.

Notation (as in the GPipe, Megatron-LM and zero-bubble papers):
    p   pipeline stages = ranks of the pipeline group
    m   micro-batches per step
    v   virtual stages (model chunks) per rank, for the interleaved schedule; S = p * v stages in all
    F   forward of one micro-batch through one stage; B its backward; the zero-bubble schedule splits B into
        BI (gradient w.r.t. the stage's input, which the previous stage waits for) and BW (gradient w.r.t. the
        stage's weights, which nobody waits for)

Virtual stage s lives on pipeline rank s % p (Megatron's interleaving: rank r holds chunks k = 0..v-1, i.e.
stages r, r + p, r + 2p, ...), or for the V-shaped ZB-V and DualPipeV (parlab/schemes/pipeline/schedules_v.py, v = 2) on
ranks 0, 1, ..., p-1, p-1, ..., 1, 0. Ranks here are ranks *within the pipeline group*; the executor turns them into
global ranks, so that several pipelines can run side by side on a device mesh.

Bubble: the fraction of a step a rank sits idle, averaged over ranks. With F and B costs t_f, t_b:
    GPipe, 1F1B        (p-1) / (m + p - 1)           each rank idles (p-1)(t_f + t_b) out of (m + p - 1)(t_f + t_b)
    interleaved        (p-1) / (v m + p - 1)         the fill and drain are v times shorter: stages are v x thinner
    zero bubble (H1)   (p-1)(t_f + t_bi - t_bw) / (m (t_f + t_bi + t_bw) + (p-1)(t_f + t_bi - t_bw))
                                                     the weight-gradient passes fill the 1F1B drain
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from parlab.schemes.pipeline import schedules_v
from parlab.schemes.pipeline.actions import SPAN_KIND, Action, Schedule, exact_costs

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank in a V: parlab/schemes/pipeline/schedules_v.py
# -------------------------------------------------------------------------------------- schedules, as data


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

    Megatron-LM warms up with 2 (p - 1 - r) + (v - 1) N instead (megatron/core/pipeline_parallel/schedules.py,
    forward_backward_pipelining_with_interleaving; N its micro-batch group size, p by default; capped at m v). Our
    reading of why twice p - 1 - r, from its executor: a steady iteration runs one F and one B and only then swaps,
    in one exchange, what they produced, so a gradient waits at every hop for the end of the iteration that made it.
    Our executor sends asynchronously and starts each action as soon as its input is there; the ideal timelines
    show the smaller count reaches the same bubble with fewer activations held. megatron=True: Megatron's, N = p.
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
    """The schedule `name` (one of SCHEDULES) for p ranks, m micro-batches, v chunks per rank (interleaved; 2 for
    the V schedules). costs: only the zero-bubble schedule depends on them (where its postponed BW passes go)."""
    check_schedule_args(name, p, m, v)
    if name in V_SCHEDULES:
        return schedules_v.zbv(p, m) if name == "zbv" else schedules_v.dualpipev(p, m)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v, megatron_warmup)
    return zero_bubble_h1(p, m, costs)


MAX_MICROBATCHES = 1024  # micro-batches per step that a run here can check and execute within seconds


def check_schedule_args(name: str, p: int, m: int, v: int = 1) -> None:
    """Reject what a schedule cannot run, with the reason."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}")
    for what, n in (("stages p", p), ("microbatches m", m), ("virtual stages v", v)):
        if n < 1:
            raise ValueError(f"{what}={n} must be >= 1")
    if m > MAX_MICROBATCHES:
        raise ValueError(
            f"microbatches m={m}: at most {MAX_MICROBATCHES} per step here (each is a forward and a backward on "
            f"every stage, and checking the schedule takes seconds per thousand; at m = {MAX_MICROBATCHES} the "
            f"1F1B bubble (p-1)/(m+p-1) is under 1% for p <= 8)"
        )
    if name in V_SCHEDULES:
        schedules_v.check_v_args(name, p, m, v)
    elif name != "interleaved" and v != 1:
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
        for a in acts:
            if a.op not in SPAN_KIND or not (0 <= a.mb < schedule.m) or not (0 <= a.chunk < schedule.v):
                raise ScheduleError(f"rank {r}: action {a} is out of range (m={schedule.m}, v={schedule.v})")
        seen = {(a.op, a.mb, a.chunk) for a in acts}  # a set: looked up m x v times (a list made this m^2)
        if len(seen) != len(acts):
            raise ScheduleError(f"rank {r} runs an action twice")
        for mb in range(schedule.m):
            for k in range(schedule.v):
                has_b = ("B", mb, k) in seen
                has_split = ("BI", mb, k) in seen and ("BW", mb, k) in seen
                if ("F", mb, k) not in seen or has_b == has_split:
                    raise ScheduleError(f"rank {r}: micro-batch {mb} chunk {k} needs one F and one B (or BI + BW)")


def simulate(schedule: Schedule, costs: dict | None = None, hop=0) -> list[Timed]:
    """The ideal timeline: each rank runs its actions in order, each as soon as the rank is free and its inputs
    have arrived. Times are exact fractions of the costs (default DEFAULT_COSTS). hop: what a message between two
    ranks costs, in the same units (default 0: communication is free; the planner gives latency + bytes/bandwidth).

    Raises ScheduleError if some rank waits for something that never happens (a deadlock).
    """
    costs, hop = exact_costs(costs), Fraction(hop)
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
                start = max([free[r]] + [done[d] + (hop if schedule.rank_of(d[2]) != r else 0) for d in deps])
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
    dst receives them, each named (mb, receiving stage). A hand-over between two stages of the same rank (the tip
    of a V) is no message: it is left out."""
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
    return {key: lists for key, lists in channels.items() if key[0] != key[1]}


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
    if name in V_SCHEDULES:
        return schedules_v.bubble_formula_v(name, p, m, costs)
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
