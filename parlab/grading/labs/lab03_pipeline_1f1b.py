"""Lab 03's checks: the 1F1B order, the same under a memory cap (in lab03_capped.py, with the prediction of its
bubble), an executor whose messages all share one process group, and the zero-bubble split of the lab model's
SwiGLU MLP (in lab03_zero_bubble.py); see parlab/grading for collect_/judge_.

The executor runs on a toy pipeline: S = p v stages, stage s computes y = tanh(x W_s^T) on micro-batches of
[b, H] rows (float64), the last stage's loss is 0.5 |y - target|^2 / BATCH summed over its rows. `StageWork` is
what one rank computes; the executor you write only decides when to receive and send.
"""

from __future__ import annotations

from contextlib import contextmanager
from fractions import Fraction

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.grading.labs import error_summary, lab03_capped, lab03_zero_bubble, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.schemes.pipeline.actions import Action, Schedule
from parlab.schemes.pipeline.schedules import ScheduleError, bubble, make_schedule, messages, peak_inflight, validate

# This lab's checks written in other files: the grader looks each one up here, then in these.
PARTS = (lab03_capped, lab03_zero_bubble)

# What no answer may call (parlab/grading/labs/guard.py): the schedules, the executor and the lesson's helpers.
# parlab/schemes/pipeline/actions.py (Action, Schedule: the notation, with stage() and rank_of()) is handed out.
LIBRARY = (
    "schemes/pipeline/schedules.py",
    "schemes/pipeline/schedules_v.py",
    "schemes/pipeline/executor.py",
    "lessons/pipeline.py",
)

# The predictions' theory, one function per PREDICT cell: what its judge scores against.
THEORY = {"capped_bubble": lab03_capped.capped_theory}

ORDER_CASES = [(4, 8), (3, 7), (4, 2), (2, 5)]  # (p, m); (4, 2) has fewer micro-batches than stages
EXECUTOR_LAUNCH = {"timeout": 10, "echo": False}  # a deadlock is diagnosed in ~2 s; 10 s stops anything else
# (schedule, p, m, v). Interleaved on 2 ranks: each pair of ranks exchanges activations and gradients both ways,
# on the one group the executor may use.
EXECUTOR_CASES = [
    ("gpipe", 4, 4, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved", 4, 8, 2),
    ("interleaved", 2, 4, 2),
    ("interleaved", 2, 8, 3),
]
H, BATCH = 8, 16  # the toy pipeline: hidden size; the global batch is [BATCH, H], a micro-batch [BATCH / m, H]

STRUCTURAL = {
    "order": "the order itself, simulated by the grader for several (p, m), m < p included: every micro-batch "
    "forward and backward once, no deadlock, messages in order, the bubble of (p-1)/(m+p-1), and the most "
    "micro-batches in flight on each rank against 1F1B's bound; no call into parlab's schedules",
    "capped": "your orders under a memory cap k (k < p, k = p, k = 1), simulated by the grader: complete, no "
    "deadlock, messages in order, at most k micro-batches in flight on every rank, and the bubble of the ideal "
    "timeline no more than the least possible under the cap (the grader's formula, not an order of its own); no "
    "call into parlab's schedules",
    "capped_bubble": "the predicted least bubble under a cap at a size no check prints (p = 8, m = 24, k = 3), "
    "against the grader's formula (within 1%)",
    "executor": "your executor on live ranks for GPipe, 1F1B and interleaved 1F1B (on 4 ranks, and on 2 where "
    "both kinds of message share each direction), each launched separately with a short timeout (a deadlock FAILs "
    "with the launcher's diagnosis): each rank ran its actions in the schedule's order, every action received the "
    "very message meant for it (compared with one device's activations and gradients), the gradients of every "
    "stage match one device, each rank sent and received exactly the messages the schedule implies (peer, count, "
    "bytes, seen at the process group), no collective, every message on the default process group without a tag; "
    "no call into parlab's executor",
    "zero_bubble": "your split backward of the lab model's SwiGLU MLP in two action orders (the last rank's in "
    "ZB-H1, and every BW postponed to the end in reverse): each BI's input gradient and the summed weight gradients "
    "match autograd, the FLOPs of the matrix products in each call (counted at the aten level) show that BI does "
    "no weight-gradient product and BW does not redo BI's, and no operator ever ran on a tensor that requires "
    "grad (no autograd); no call into parlab's executor",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ----------------------------------------------------------------------------------------------- 1F1B order


def as_schedule(actions_of, p: int, m: int) -> Schedule:
    """Your function's actions for every rank, as the Schedule that parlab.schemes.pipeline.executor checks and runs."""
    return Schedule("yours", p, m, 1, [[Action(op, mb) for op, mb in actions_of(r, p, m)] for r in range(p)])


def _orders(actions_of, p: int, m: int) -> list[list[list]]:
    """Every rank's actions as plain data: [[op, micro-batch], ...] per rank."""
    return [[[str(op), int(mb)] for op, mb in actions_of(r, p, m)] for r in range(p)]


def _from_orders(orders, p: int, m: int) -> Schedule:
    if len(orders) != p:
        raise ScheduleError(f"{len(orders)} ranks' orders for p={p}")
    actions = [[Action(str(op), int(mb)) for op, mb in rank_orders] for rank_orders in orders]
    return Schedule("yours", p, m, 1, actions)


def collect_order(one_f_one_b_actions) -> dict:
    with library_calls(LIBRARY) as called:
        orders = {f"{p},{m}": _orders(one_f_one_b_actions, p, m) for p, m in ORDER_CASES}
    return {"orders": orders, "library": called}


def judge_order(data) -> list[str]:
    lines = [library_line("your 1F1B order", data.get("library", ["(calls not recorded)"]))]
    for p, m in ORDER_CASES:
        try:
            schedule = _from_orders(data["orders"][f"{p},{m}"], p, m)
            timeline = validate(schedule)  # the ideal timeline, unit costs F = 1, B = 2
        except (ScheduleError, ValueError, TypeError, KeyError, IndexError) as error:
            lines.append(f"p={p}, m={m}: {error}: FAIL")
            continue
        lines.append(f"p={p}, m={m}: every micro-batch forward and backward once, no deadlock, messages in order: PASS")
        ideal, formula = bubble(timeline, p), Fraction(p - 1, m + p - 1)
        verdict = "PASS" if ideal == formula else "FAIL"
        lines.append(f"p={p}, m={m}: bubble of the ideal timeline {ideal} vs (p-1)/(m+p-1) = {formula}: {verdict}")
        peaks = peak_inflight(schedule)  # counted from the order: F adds a micro-batch's activations, B frees them
        verdict = "PASS" if peaks == [min(p - r, m) for r in range(p)] else "FAIL"
        bound = "p - r" if m >= p else "min(p - r, m)"
        lines.append(f"p={p}, m={m}: most micro-batches in flight on ranks 0..{p - 1}: {peaks} vs {bound}: {verdict}")
    return lines


# ------------------------------------------------------------------------------------------------ executor


def chain_problem(stages: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The toy pipeline: one [H, H] weight per stage, the global batch's inputs and targets ([BATCH, H] each), on
    the host (the seeded draw; StageWork moves its share to parlab.device(), the references stay on one device)."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(H, H, generator=gen, dtype=torch.float64) / H**0.5 for _ in range(stages)]  # host: the draw
    x = torch.randn(BATCH, H, generator=gen, dtype=torch.float64)  # host: the seeded draw
    return weights, x, torch.randn(BATCH, H, generator=gen, dtype=torch.float64)  # host: the seeded draw


class StageWork:
    """What rank r computes, for the executor (which only receives and sends).

        empty()              a new [b, H] tensor to receive one message (an activation or a gradient) into
        first_input(mb)      micro-batch mb's input [b, H]: what stage 0's forward starts from
        forward(a, x)        the output [b, H] of action a's stage on input x (it keeps what its backward needs)
        backward(a, grad)    d loss / d (input of a's stage), [b, H], from grad = d loss / d (its output); on the
                             last stage grad is None (the loss starts the backward); on stage 0 it returns None

    The stage of action a on rank r is schedule.stage(r, a.chunk). Gradients add up in the stages' weights.
    """

    def __init__(self, schedule: Schedule, rank: int):
        weights, x, target = chain_problem(schedule.num_stages)
        device = parlab.device()
        self.schedule, self.rank, self.last = schedule, rank, schedule.num_stages - 1
        self.weights = {
            k: weights[schedule.stage(rank, k)].clone().to(device).requires_grad_() for k in range(schedule.v)
        }
        self.xs, self.targets = x.to(device).chunk(schedule.m), target.to(device).chunk(schedule.m)  # m of [b, H]
        self.held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.ran: list[list] = []  # the actions run, in order: [op, mb, chunk]
        self.received: list[list] = []  # what each action was handed: [op, mb, chunk, tensor]

    def empty(self) -> torch.Tensor:
        return torch.empty_like(self.xs[0])

    def first_input(self, mb: int) -> torch.Tensor:
        return self.xs[mb].clone()

    def forward(self, a: Action, x: torch.Tensor) -> torch.Tensor:
        self.ran.append(["F", a.mb, a.chunk])
        if self.schedule.stage(self.rank, a.chunk) > 0:
            self.received.append(["F", a.mb, a.chunk, x.detach().clone()])
        x = x.detach().clone().requires_grad_()
        y = torch.tanh(x @ self.weights[a.chunk].T)  # [b, H]
        out = y
        if self.schedule.stage(self.rank, a.chunk) == self.last:
            out = 0.5 * ((y - self.targets[a.mb]) ** 2).sum() / BATCH  # this micro-batch's share of the loss
        self.held[(a.mb, a.chunk)] = (x, out)
        return y.detach()

    def backward(self, a: Action, grad: torch.Tensor | None) -> torch.Tensor | None:
        self.ran.append([a.op, a.mb, a.chunk])
        if grad is not None:
            self.received.append([a.op, a.mb, a.chunk, grad.detach().clone()])
        x, out = self.held.pop((a.mb, a.chunk))
        (out if grad is None else (out * grad).sum()).backward()  # the same gradients as backward(out, grad)
        return x.grad if self.schedule.stage(self.rank, a.chunk) > 0 else None


@contextmanager
def channels():
    """Record, for every point-to-point call made inside the block, whether it ran on the default process group and
    with which tag: [{"op", "peer", "world", "tag"}, ...]. (probe.recording sees the calls, not these two.)"""
    from torch._C._distributed_c10d import ProcessGroup

    world = dist.distributed_c10d._get_default_group().group_name
    tag_at = {"send": 2, "recv": 2, "recv_anysource": 1}  # ProcessGroup.send(tensors, dst, tag), recv_anysource(t, tag)
    seen: list[dict] = []

    def wrap(name, original):
        def recorded(self, *args, **kwargs):
            tag = args[tag_at[name]] if len(args) > tag_at[name] else kwargs.get("tag", 0)
            peer = args[1] if name != "recv_anysource" and len(args) > 1 else -1
            seen.append({"op": name, "peer": int(peer), "world": self.group_name == world, "tag": int(tag)})
            return original(self, *args, **kwargs)

        return recorded

    originals = {name: getattr(ProcessGroup, name) for name in tag_at}
    with probe.wrapped(ProcessGroup, originals, wrap):
        yield seen


def run_executor(execute, name: str, p: int, m: int, v: int) -> dict:
    """Rank code: your executor runs this rank's actions of one step of schedule `name` on the toy pipeline."""
    r = dist.get_rank()
    schedule = make_schedule(name, p, m, v)
    work = StageWork(schedule, r)
    with probe.recording(keep_sent_data=False) as calls, channels() as p2p, library_calls(LIBRARY) as called:
        execute(schedule, work)
    grads = {f"W{schedule.stage(r, k)}": w.grad for k, w in work.weights.items()}
    return {"grads": grads, "ran": work.ran, "received": work.received, "calls": calls, "p2p": p2p, "library": called}


def chain_reference(stages: int) -> dict[str, torch.Tensor]:
    """One device: the whole batch through all stages, d loss / d W_s of every stage."""
    weights, x, target = chain_problem(stages)
    weights = [w.requires_grad_() for w in weights]
    for w in weights:
        x = torch.tanh(x @ w.T)
    (0.5 * ((x - target) ** 2).sum() / BATCH).backward()
    return {f"W{s}": w.grad for s, w in enumerate(weights)}


def chain_messages(stages: int, m: int) -> dict[tuple[str, int, int], torch.Tensor]:
    """One device: every message of one step, by what receives it. ("act", mb, s): the input [b, H] of stage s's
    forward of micro-batch mb (s > 0); ("grad", mb, s): d loss / d (output of stage s) for micro-batch mb, which
    stage s's backward receives (s < stages - 1)."""
    weights, x, target = chain_problem(stages)
    weights = [w.requires_grad_() for w in weights]
    out = {}
    for mb, (a, t) in enumerate(zip(x.chunk(m), target.chunk(m), strict=True)):
        outputs = []
        for s, w in enumerate(weights):
            if s > 0:
                out[("act", mb, s)] = a.detach().clone()
            a = torch.tanh(a @ w.T)
            a.retain_grad()
            outputs.append(a)
        (0.5 * ((a - t) ** 2).sum() / BATCH).backward()  # this micro-batch's share of the loss, as StageWork's
        out.update({("grad", mb, s): y.grad for s, y in enumerate(outputs[:-1])})
    return out


def _message(key: tuple[str, int, int]) -> str:
    kind, mb, s = key
    if kind == "act":
        return f"micro-batch {mb}'s activation from stage {s - 1} to stage {s}"
    return f"micro-batch {mb}'s gradient from stage {s + 1} to stage {s}"


def wrong_receives(ranks, schedule: Schedule) -> tuple[int, int, str]:
    """(receives, wrong ones, the first wrong one in words) of a run, against one device's messages. The first
    wrong receive named is one that got another message of the step (a mix-up), if there is one: the later ones
    are mostly its consequences (computed from wrong inputs, they match no message at all)."""
    reference = chain_messages(schedule.num_stages, schedule.m)

    def same(got, expected) -> bool:
        return got.shape == expected.shape and torch.allclose(got, expected, rtol=0, atol=1e-10)

    total, wrong, mixed_up, other = 0, 0, "", ""
    for r, res in enumerate(ranks):
        for op, mb, chunk, got in res["received"]:
            s = schedule.stage(r, int(chunk))
            key = ("act" if op == "F" else "grad", int(mb), s)  # the message this action must receive
            total += 1
            if key in reference and same(got, reference[key]):
                continue
            wrong += 1
            instead = next((k for k, t in reference.items() if same(got, t)), None)
            where = f"rank {r}'s {op}{mb} (stage {s}) received "
            if instead is not None and not mixed_up:
                mixed_up = where + f"{_message(instead)}, not {_message(key)}"
            elif not other:
                other = where + f"data that is no message of this step, not {_message(key)}"
    return total, wrong, mixed_up or other


def expected_messages(schedule: Schedule, message_bytes: int) -> list[dict]:
    """For each rank: {(op, peer): (count, bytes)} of the sends and receives the schedule implies."""
    counts: list[dict] = [{} for _ in range(schedule.p)]
    for (src, dst, _kind), (sent, received) in messages(schedule).items():
        for rank, op, peer, n in ((src, "send", dst, len(sent)), (dst, "recv", src, len(received))):
            before = counts[rank].get((op, peer), (0, 0))
            counts[rank][(op, peer)] = (before[0] + n, before[1] + n * message_bytes)
    return counts


def measured_messages(calls) -> dict:
    counts: dict = {}
    for c in calls:
        key = (c["op"].replace("recv_anysource", "recv"), int(c["peer"]))
        before = counts.get(key, (0, 0))
        counts[key] = (before[0] + 1, before[1] + int(c["bytes"]))
    return counts


def _case_name(name: str, p: int, m: int, v: int) -> str:
    return f"{name} (p={p}, m={m}" + (f", v={v})" if v > 1 else ")")


def collect_executor(execute) -> dict:
    cases, unwritten = {}, None
    for name, p, m, v in EXECUTOR_CASES:  # one launch each: a deadlock in one leaves the others' verdicts
        label = _case_name(name, p, m, v)
        if unwritten:  # the handout's stub: no need to launch it again
            cases[label] = {"error": unwritten}
            continue
        try:
            cases[label] = {"ranks": list(parlab.launch(run_executor, p, execute, name, p, m, v, **EXECUTOR_LAUNCH))}
        except Exception as exc:  # a rank's error (RankError), the launcher's diagnosis of a hang (LaunchTimeout)
            cases[label] = {"error": error_summary(exc)}
            unwritten = cases[label]["error"] if "NotImplementedError" in cases[label]["error"] else None
    return {"cases": cases}


def _described(counts: dict) -> str:
    return ", ".join(f"{op} {peer}: {n}" for (op, peer), (n, _b) in sorted(counts.items())) or "nothing"


def _first_difference(ran: list, expected: list) -> str:
    """Where a rank's actions first leave the schedule's order, in words."""

    def label(action) -> str:
        op, mb, chunk = action
        return f"{op}{mb}" + (f"c{chunk}" if chunk else "")

    for i, (got, want) in enumerate(zip(ran, expected, strict=False)):
        if list(got) != list(want):
            return f"action {i} was {label(got)}, the schedule's is {label(want)}"
    return f"it ran {len(ran)} actions, the schedule has {len(expected)}"


def _one_group(ranks) -> str:
    """'' when every point-to-point call ran on the default group with tag 0, else the first that did not."""
    for r, res in enumerate(ranks):
        for c in res["p2p"]:
            if not c["world"] or c["tag"] != 0:
                where = "on another process group" if not c["world"] else f"with tag {c['tag']}"
                return f"rank {r}'s {c['op']} (peer {c['peer']}) ran {where}"
    return ""


def judge_executor(data) -> list[str]:
    lines, called = [], []
    for name, p, m, v in EXECUTOR_CASES:
        label = _case_name(name, p, m, v)
        case = data["cases"].get(label, {"error": "not run"})
        if "error" in case:
            lines.append(f"{label}: did not complete: {case['error']}: FAIL")
            continue
        ranks, schedule = case["ranks"], make_schedule(name, p, m, v)
        called += [call for res in ranks for call in res.get("library", ["(calls not recorded)"])]
        lines.append(f"{label}: every rank finished (no deadlock): PASS")
        in_order = [[[a.op, a.mb, a.chunk] for a in acts] for acts in schedule.actions]
        wrong = [r for r in range(p) if ranks[r]["ran"] != in_order[r]]
        verdict = (
            "PASS"
            if not wrong
            else f"rank {wrong[0]}: {_first_difference(ranks[wrong[0]]['ran'], in_order[wrong[0]])}: FAIL"
        )
        lines.append(f"{label}: each rank ran its actions in the schedule's order: {verdict}")
        total, wrong, first = wrong_receives(ranks, schedule)
        verdict = "PASS" if not wrong else f"{wrong} of {total} did not, e.g. {first}: FAIL"
        lines.append(f"{label}: every action received the message meant for it: {verdict}")
        grads = {key: g for res in ranks for key, g in res["grads"].items()}
        lines.append(compare(f"{label}: dL/dW of every stage", grads, chain_reference(p * v)).line)
        expected = expected_messages(schedule, (BATCH // m) * H * 8)
        bad = ""
        for r in range(p):
            calls = ranks[r]["calls"]
            others = probe.library_collectives(calls)
            got = measured_messages([c for c in calls if c["op"] in probe.P2P])
            if others or got != expected[r]:
                bad = f"rank {r} expected {_described(expected[r])}, made {_described(got)}"
                bad += f" and collectives {others[:3]}" if others else ""
                break
        verdict = "PASS" if not bad else f"{bad}: FAIL"
        lines.append(f"{label}: every rank sent and received exactly the schedule's messages, no collective: {verdict}")
        off = _one_group(ranks)
        verdict = "PASS" if not off else f"{off}: FAIL"
        lines.append(f"{label}: every message on the default process group, without a tag: {verdict}")
    lines.append(library_line("your executor", called, "parlab's pipeline executor and schedules"))
    return lines
