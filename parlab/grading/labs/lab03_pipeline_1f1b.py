"""Lab 03's checks: 1F1B under a memory cap and the prediction of its least bubble (in lab03_capped.py), an
executor for any schedule (F, B, BI, BW; one chunk per rank, interleaved chunks, the two chunks of a V) whose
messages all share one process group, and the zero-bubble split of the lab model's SwiGLU MLP within a memory
budget (in lab03_zero_bubble.py); see parlab/grading for collect_/judge_.

The executor runs on a toy pipeline: S = p v stages, stage s computes y = tanh(x W_s^T) on micro-batches of
[b, H] rows (float64), the last stage's loss is 0.5 |y - target|^2 / BATCH summed over its rows. `StageWork` is
what one rank computes; the executor you write only decides when to receive and send.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.grading.labs import error_summary, lab03_capped, lab03_zero_bubble, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab03_setup import LIBRARY
from parlab.schemes.pipeline.actions import Action, Schedule
from parlab.schemes.pipeline.schedules import make_schedule, messages

# This lab's checks written in other files: the grader looks each one up here, then in these.
PARTS = (lab03_capped, lab03_zero_bubble)

# What no answer may call (parlab/grading/labs/guard.py): the schedules (their simulator and message lists too), the
# executor and the lesson's helpers. parlab/schemes/pipeline/actions.py (Action, Schedule: the notation, with
# stage() and rank_of()) is handed out.

# The predictions' theory, one function per PREDICT cell: what its judge scores against.
THEORY = {"capped_bubble": lab03_capped.capped_theory}

EXECUTOR_LAUNCH = {"timeout": 10, "echo": False}  # a deadlock is diagnosed in ~2 s; 10 s stops anything else
# (schedule, p, m, v), one launch each. On 2 ranks (interleaved, and both V schedules) each direction between the
# two ranks carries activations and gradients, on the one group the executor may use; zb splits every backward
# into BI and BW; the V schedules hand stage p - 1's output to stage p (and the gradient back) on rank p - 1
# itself, and on 4 ranks send both kinds each way between neighbours; dualpipev mixes whole backwards (B) with
# split ones (BI, BW).
EXECUTOR_CASES = [
    ("1f1b", 4, 8, 1),
    ("interleaved", 2, 4, 2),
    ("zb", 4, 8, 1),
    ("zbv", 2, 4, 2),
    ("zbv", 4, 8, 2),
    ("dualpipev", 2, 4, 2),
]
H, BATCH = 8, 16  # the toy pipeline: hidden size; the global batch is [BATCH, H], a micro-batch [BATCH / m, H]

STRUCTURAL = {
    "capped_bubble": "the predicted least bubble under a cap at a size no check prints (p = 8, m = 24, k = 3), "
    "against the grader's formula (within 1%); the prediction cell may compute but imports nothing but math",
    "capped": "your orders under a memory cap k (k < p, k = p, k = 1), simulated by the grader: complete, no "
    "deadlock, messages in order, at most k micro-batches in flight on every rank, and the bubble of the ideal "
    "timeline no more than the least possible under the cap (the grader's formula, not an order of its own); no "
    "call into parlab's schedules (their simulator included)",
    "executor": "your executor on live ranks for 1F1B, interleaved 1F1B, ZB-H1 (BI and BW), ZB-V and DualPipeV "
    "(two chunks per rank in a V, the tip's hand-over on one rank), on 4 ranks and on 2 (where both kinds of "
    "message share each direction), each launched separately with a short timeout (a deadlock FAILs with the "
    "launcher's diagnosis): each rank ran its actions in the schedule's order, every action received the very "
    "message meant for it (compared with one device's activations and gradients), the gradients of every stage "
    "match one device, each rank sent and received exactly the messages the schedule implies (peer, count, bytes, "
    "seen at the process group; nothing to itself), no collective, every message on the default process group "
    "without a tag; no call into parlab's executor or schedules (their message lists included)",
    "zero_bubble": "your split backward of the lab model's SwiGLU MLP in two action orders (the last rank's in "
    "ZB-H1, and every BW postponed to the end in reverse): each BI's input gradient and the summed weight gradients "
    "match autograd; the FLOPs of the matrix products in each call (counted at the aten level): at most three per "
    "BI (no weight-gradient product), at most five per BW; the bytes of the tensors the stage holds after every "
    "call (its weights and gradients aside, each storage counted whole, once) within the budget of the micro-batches "
    "between their F and their BI and between their BI and their BW, nothing left at the end; no operator ever ran "
    "on a tensor that requires grad (no autograd); no call into parlab's pipeline code",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


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
        forward(a, x)        F: the output [b, H] of action a's stage on input x (it keeps what its backward needs)
        backward(a, grad)    B or BI: d loss / d (input of a's stage), [b, H], from grad = d loss / d (its output);
                             on the last stage grad is None (the loss starts the backward); on stage 0 it returns
                             None. B also adds the weight's gradient; BI leaves that to the BW of the same
                             micro-batch and chunk
        weight(a)            BW: adds the weight's gradient of a's micro-batch and chunk (after its BI); None

    The stage of action a on rank r is schedule.stage(r, a.chunk). Gradients add up over the micro-batches.
    """

    def __init__(self, schedule: Schedule, rank: int):
        weights, x, target = chain_problem(schedule.num_stages)
        device = parlab.device()
        self.schedule, self.rank, self.last = schedule, rank, schedule.num_stages - 1
        self.weights = {k: weights[schedule.stage(rank, k)].to(device) for k in range(schedule.v)}  # chunk -> [H, H]
        self.grads = {k: torch.zeros_like(w) for k, w in self.weights.items()}
        self.xs, self.targets = x.to(device).chunk(schedule.m), target.to(device).chunk(schedule.m)  # m of [b, H]
        self.held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # F -> B/BI: (x, y)
        self.pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # BI -> BW: (x, dL/dz)
        self.ran: list[list] = []  # the actions run, in order: [op, mb, chunk]
        self.received: list[list] = []  # what each action was handed: [op, mb, chunk, tensor]

    def _stage(self, a: Action) -> int:
        return self.schedule.stage(self.rank, a.chunk)

    def empty(self) -> torch.Tensor:
        return torch.empty_like(self.xs[0])

    def first_input(self, mb: int) -> torch.Tensor:
        return self.xs[mb].clone()

    def forward(self, a: Action, x: torch.Tensor) -> torch.Tensor:
        self.ran.append(["F", a.mb, a.chunk])
        if self._stage(a) > 0:
            self.received.append(["F", a.mb, a.chunk, x.detach().clone()])
        x = x.detach().clone()
        y = torch.tanh(x @ self.weights[a.chunk].T)  # [b, H]
        self.held[(a.mb, a.chunk)] = (x, y)
        return y.clone()

    def backward(self, a: Action, grad: torch.Tensor | None) -> torch.Tensor | None:
        self.ran.append([a.op, a.mb, a.chunk])
        if grad is not None:
            self.received.append([a.op, a.mb, a.chunk, grad.detach().clone()])
        if a.op not in ("B", "BI"):
            raise ValueError(f"backward() runs a B or a BI, not {a.op}")
        x, y = self.held.pop((a.mb, a.chunk))
        if self._stage(a) == self.last:  # the loss 0.5 |y - target|^2 / BATCH starts the backward
            grad = (y - self.targets[a.mb]) / BATCH
        grad_z = grad * (1 - y * y)  # through tanh: [b, H]
        if a.op == "B":
            self.grads[a.chunk] += grad_z.T @ x
        else:  # BI: the weight's gradient waits for BW
            self.pending[(a.mb, a.chunk)] = (x, grad_z)
        return grad_z @ self.weights[a.chunk] if self._stage(a) > 0 else None

    def weight(self, a: Action) -> None:
        self.ran.append([a.op, a.mb, a.chunk])
        if a.op != "BW":
            raise ValueError(f"weight() runs a BW, not {a.op}")
        x, grad_z = self.pending.pop((a.mb, a.chunk))
        self.grads[a.chunk] += grad_z.T @ x


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
    grads = {f"W{schedule.stage(r, k)}": g for k, g in work.grads.items()}
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
