"""Lab 03's checks: the 1F1B order, a pipeline executor's point-to-point messages, the zero-bubble split of a
stage's backward (in lab03_zero_bubble.py), and a prediction of a pipeline's traffic (see parlab/grading for
collect_/judge_).

The executor runs on a toy pipeline: S = p v stages, stage s computes y = tanh(x W_s^T) on micro-batches of
[b, H] rows (float64), the last stage's loss is 0.5 |y - target|^2 / BATCH summed over its rows. `StageWork` is
what one rank computes; the executor you write only decides when to receive and send.
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.core.models import GPTConfig, build_model
from parlab.grading.labs import error_summary, lab03_zero_bubble, prediction_lines, run_check
from parlab.schemes.pipeline.actions import Action, Schedule
from parlab.schemes.pipeline.executor import Boundary, build_stages, run_step, theory_send_bytes
from parlab.schemes.pipeline.schedules import ScheduleError, bubble, make_schedule, messages, peak_inflight, validate

# This lab's checks written in other files: the grader looks each one up here, then in these.
PARTS = (lab03_zero_bubble,)

ORDER_CASES = [(4, 8), (3, 7), (4, 2), (2, 5)]  # (p, m); (4, 2) has fewer micro-batches than stages
EXECUTOR_LAUNCH = {"timeout": 10, "echo": False}  # a deadlock is diagnosed in ~2 s; 10 s stops anything else
# (schedule, p, m, v). Interleaved on 2 ranks: each pair of ranks exchanges activations and gradients both ways.
EXECUTOR_CASES = [("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 2)]
H, BATCH = 8, 16  # the toy pipeline: hidden size; the global batch is [BATCH, H], a micro-batch [BATCH / m, H]
TRAFFIC = {"p": 4, "v": 2, "m": 8, "b": 1}  # the predicted run: interleaved 1F1B, one row per micro-batch
TRAFFIC_CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=8)  # float64: [b, T, H] messages
LAUNCH = {"timeout": 60, "echo": False}

STRUCTURAL = {
    "order": "the order itself, simulated by the grader for several (p, m), m < p included: every micro-batch "
    "forward and backward once, no deadlock, messages in order, the bubble of (p-1)/(m+p-1), and the most "
    "micro-batches in flight on each rank against 1F1B's bound",
    "executor": "your executor on live ranks for GPipe, 1F1B and interleaved 1F1B (on 4 ranks, and on 2), each "
    "launched separately with a short timeout (a deadlock FAILs with the launcher's diagnosis): each rank ran its "
    "actions in the schedule's order, every action received the very message meant for it (compared with one "
    "device's activations and gradients), the gradients of every stage match one device, and each rank sent and "
    "received exactly the messages the schedule implies (peer, count, bytes, seen at the process group), no "
    "collective",
    "zero_bubble": "your split backward in two action orders (the last rank's in ZB-H1, and every BW postponed to "
    "the end in reverse): each BI's input gradient and the summed weight gradients match autograd, and the FLOPs "
    "of the matrix products in each call (counted at the aten level, autograd's included) show that BI does no "
    "weight-gradient GEMM and BW no input-gradient GEMM",
    "traffic": "the predicted bytes each of ranks 0 and 1 sends in one interleaved step, against the grader's "
    "count from the schedule and against the bytes measured at the process group in a real run",
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
    return {"orders": {f"{p},{m}": _orders(one_f_one_b_actions, p, m) for p, m in ORDER_CASES}}


def judge_order(data) -> list[str]:
    lines = []
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
    """The toy pipeline: one [H, H] weight per stage, the global batch's inputs and targets ([BATCH, H] each)."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(H, H, generator=gen, dtype=torch.float64) / H**0.5 for _ in range(stages)]
    x = torch.randn(BATCH, H, generator=gen, dtype=torch.float64)
    return weights, x, torch.randn(BATCH, H, generator=gen, dtype=torch.float64)


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
        self.schedule, self.rank, self.last = schedule, rank, schedule.num_stages - 1
        self.weights = {k: weights[schedule.stage(rank, k)].clone().requires_grad_() for k in range(schedule.v)}
        self.xs, self.targets = x.chunk(schedule.m), target.chunk(schedule.m)  # m micro-batches of [b, H]
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


def run_executor(execute, name: str, p: int, m: int, v: int) -> dict:
    """Rank code: your executor runs this rank's actions of one step of schedule `name` on the toy pipeline."""
    r = dist.get_rank()
    schedule = make_schedule(name, p, m, v)
    work = StageWork(schedule, r)
    with probe.recording(keep_sent_data=False) as calls:
        execute(schedule, work)
    grads = {f"W{schedule.stage(r, k)}": w.grad for k, w in work.weights.items()}
    return {"grads": grads, "ran": work.ran, "received": work.received, "calls": calls}


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


def judge_executor(data) -> list[str]:
    lines = []
    for name, p, m, v in EXECUTOR_CASES:
        label = _case_name(name, p, m, v)
        case = data["cases"].get(label, {"error": "not run"})
        if "error" in case:
            lines.append(f"{label}: did not complete: {case['error']}: FAIL")
            continue
        ranks, schedule = case["ranks"], make_schedule(name, p, m, v)
        lines.append(f"{label}: every rank finished (no deadlock): PASS")
        in_order = [[[a.op, a.mb, a.chunk] for a in acts] for acts in schedule.actions]
        wrong = [r for r in range(p) if ranks[r]["ran"] != in_order[r]]
        verdict = "PASS" if not wrong else f"ranks {wrong} did not: FAIL"
        lines.append(f"{label}: each rank ran its actions in the schedule's order: {verdict}")
        total, wrong, first = wrong_receives(ranks, schedule)
        verdict = "PASS" if not wrong else f"{wrong} of {total} did not, e.g. {first}: FAIL"
        lines.append(f"{label}: every action received the message meant for it: {verdict}")
        grads = {key: g for res in ranks for key, g in res["grads"].items()}
        lines.append(compare(f"{label}: dL/dW of every stage", grads, chain_reference(p * v)).line)
        expected = expected_messages(schedule, (BATCH // m) * H * 8)
        bad = []
        for r in range(p):
            calls = ranks[r]["calls"]
            others = probe.library_collectives(calls)
            got = measured_messages([c for c in calls if c["op"] in probe.P2P])
            if others or got != expected[r]:
                bad.append(f"rank {r}: {_described(got)}" + (f", collectives {others}" if others else ""))
        verdict = "PASS" if not bad else f"{'; '.join(bad[:2])}: FAIL"
        lines.append(f"{label}: every rank sent and received exactly the schedule's messages, no collective: {verdict}")
    return lines


# ------------------------------------------------------------------------------------- traffic prediction


def run_traffic() -> int:
    """Rank code: one step of interleaved 1F1B on the GPT (parlab.schemes.pipeline.executor's executor); the bytes this
    rank sent."""
    p, v, m, cfg = TRAFFIC["p"], TRAFFIC["v"], TRAFFIC["m"], TRAFFIC_CFG
    schedule = make_schedule("interleaved", p, m, v)
    model, r = build_model(cfg, seed=0), dist.get_rank()
    stages = build_stages(model, schedule, r)
    tokens = torch.randint(cfg.vocab_size, (TRAFFIC["b"] * m, cfg.seq_len + 1), generator=torch.Generator())
    x, y = tokens[:, :-1], tokens[:, 1:]  # [b m, T] each: the bytes sent do not depend on the tokens
    with probe.recording(keep_sent_data=False) as calls:
        run_step(schedule, stages, Boundary.of(cfg), x, y, 0)
    return probe.total_bytes(calls, "send")


def traffic_theory() -> list[int]:
    """Bytes each rank sends in one step, counted from the schedule by parlab.schemes.pipeline.executor."""
    schedule, cfg = make_schedule("interleaved", TRAFFIC["p"], TRAFFIC["m"], TRAFFIC["v"]), TRAFFIC_CFG
    return theory_send_bytes(schedule, TRAFFIC["b"] * cfg.seq_len * cfg.hidden * cfg.dtype_bytes)


def plain(value) -> float | str:
    """A prediction as plain data for the grader: a float, or (what cannot be one) a short text."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_traffic(predicted: dict) -> dict:
    measured = list(parlab.launch(run_traffic, TRAFFIC["p"], **LAUNCH))
    return {"predicted": {k: plain(predicted.get(k)) for k in ("bytes_rank0", "bytes_rank1")}, "measured": measured}


def judge_traffic(data) -> list[str]:
    theory, measured, lines = traffic_theory(), data["measured"], []
    for r in (0, 1):
        predicted = data["predicted"][f"bytes_rank{r}"]
        lines += prediction_lines(f"bytes rank {r} sends in one step", predicted, theory[r], measured[r])
    return lines
