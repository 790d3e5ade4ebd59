"""The bug hunt, part 5: a 1F1B loop over the lab model's blocks, its LM head tied to its embedding, for any number m
of micro-batches.

Each stage is one block of the lab model (stage 0 also embeds the tokens, the last stage applies the final norm,
the head and the loss). The head is the embedding matrix (`tied=True`, as GPT-2 and Llama 3.2's small models tie
them): stage 0 and the last stage each hold a copy of it, and after backward both copies must hold the gradient one
device computes for the tied matrix (Megatron's embedding group: the first and the last stage). The student's
function is the loop of one stage (Megatron's non-interleaved 1F1B: warm-up forwards, one forward and one backward
alternately, cool-down backwards), then the tied gradient; `Stage` hands it the stage's forward and backward and its
messages, the paired ones with both directions in flight together. Stage 0 takes its inputs from the data loader,
the last stage its targets from its own. Between steps every stage takes an SGD step on its parameters.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.check import compare
from parlab.core.lab_model import LabModel, build_lab_model, lab_batches, lab_loss
from parlab.grading.labs import error_summary
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab_bug_hunt_setup import (
    ALL_REDUCE,
    LIBRARY,
    PIPE_B,
    PIPE_CFG,
    PIPE_LAUNCHES,
    PIPE_LR,
    PIPE_MS,
    PIPE_STEPS,
    PIPELINE_LAUNCH,
    P,
    curve_line,
    library_verdict,
)
from parlab.runtime.errors import LaunchTimeout, RankError


def pipe_data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's token ids for m micro-batches per step: x, y [(PIPE_STEPS + 1) m PIPE_B, T], micro-batch i is
    rows [i b, (i+1) b); step k (from 0) uses micro-batches [k m, (k+1) m). One step more than the run takes."""
    x, y = lab_batches(PIPE_CFG, (PIPE_STEPS + 1) * m * PIPE_B, 1, seed=51 + m, device=parlab.device())[0]
    return x, y


def stage_parameters(model: LabModel, s: int) -> dict[str, torch.Tensor]:
    """Stage s's parameters, by the model's names: block s; the embedding on stage 0; the final norm and the
    embedding (the tied head's copy) on the last stage."""
    mine = (f"blocks.{s}.",) + (("embed.",) if s in (0, P - 1) else ()) + (("norm.",) if s == P - 1 else ())
    return {name: p for name, p in model.named_parameters() if name.startswith(mine)}


class Stage:
    """What one stage hands your 1F1B loop. s: this stage (rank), p: the number of stages. Every message is one
    micro-batch's [b, T, H]; a message towards a stage that does not exist is no message (Megatron's convention).

    forward(x) -> y           this stage's part of the model on one micro-batch (the last stage: its loss / m)
    backward(grad) -> grad_x  backward of the oldest micro-batch whose backward has not run (grad: None on the last
                              stage); returns dL/dinput (None on stage 0)
    recv_forward() -> x       the next micro-batch's input from stage s-1 (stage 0: from the data loader)
    send_forward(y)           y to stage s+1
    recv_backward() -> grad   the gradient of the oldest output still held, from stage s+1 (last stage: None)
    send_backward(grad_x)     grad_x to stage s-1
    send_forward_recv_backward(y) -> grad         the two at once, both in flight together
    send_backward_recv_forward(grad_x) -> x       the two at once, both in flight together (stage 0: from the loader)
    held                      the micro-batches whose activations this stage holds, awaiting backward (the check
                              counts them: their peak in a step is the stage's activation memory)
    tied_grad() -> grad       this stage's copy of the tied matrix's gradient, [V, H] (the first and the last
                              stage; None on the others)
    tied_group                the process group of the first and the last stage
    """

    def __init__(self, model: LabModel, s: int, m: int, inputs: Iterator[torch.Tensor], targets: Iterator, tied_group):
        self.s, self.p, self.model, self.m = s, P, model, m
        self.first, self.last = s == 0, s == P - 1
        self.inputs, self.targets = inputs, targets
        self.tied_group = tied_group
        self.positions = torch.arange(PIPE_CFG.seq_len, device=parlab.device())
        self.shape = (PIPE_B, PIPE_CFG.seq_len, PIPE_CFG.hidden)
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, output) awaiting backward, oldest first
        self.most_held = 0  # the most micro-batches whose activations this stage held at once (the step's peak)
        self.loss = 0.0

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=torch.float64, device=parlab.device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed(x) if self.first else x.requires_grad_()  # [b, T, H]
        out = self.model.blocks[self.s](h, self.positions)
        if self.last:  # this micro-batch's loss, / m: the m losses add up to the step's mean
            out = lab_loss(self.model.logits(out), next(self.targets)) / self.m  # logits: the embedding's copy
            self.loss += out.item()
        self.held.append((x, out))
        self.most_held = max(self.most_held, len(self.held))
        return out

    def backward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        x, out = self.held.pop(0)
        torch.autograd.backward(out, grad)
        return None if self.first else x.grad

    def tied_grad(self) -> torch.Tensor | None:
        if not (self.first or self.last):
            return None
        weight = self.model.embed.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        return weight.grad

    def recv_forward(self) -> torch.Tensor:
        if self.first:
            return next(self.inputs)
        x = self._empty()
        comm.recv(x, self.s - 1)
        return x

    def send_forward(self, y: torch.Tensor) -> None:
        if not self.last:
            comm.send(y.detach(), self.s + 1)

    def recv_backward(self) -> torch.Tensor | None:
        if self.last:
            return None
        grad = self._empty()
        comm.recv(grad, self.s + 1)
        return grad

    def send_backward(self, grad_x: torch.Tensor | None) -> None:
        if not self.first:
            comm.send(grad_x, self.s - 1)

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        if self.last:
            return None
        grad = self._empty()
        comm.wait_all([comm.isend(y.detach(), self.s + 1), comm.irecv(grad, self.s + 1)])
        return grad

    def send_backward_recv_forward(self, grad_x: torch.Tensor | None) -> torch.Tensor:
        if self.first:
            return next(self.inputs)
        x = self._empty()
        comm.wait_all([comm.isend(grad_x, self.s - 1), comm.irecv(x, self.s - 1)])
        return x


def run_1f1b(one_f_one_b, ms: tuple[int, ...]) -> dict[int, list[dict]]:
    """Rank code: for each m of `ms`, stage s = rank s runs PIPE_STEPS steps of `one_f_one_b(stage, m)` (your code)
    from the same weights, each followed by SGD on the stage's parameters; after each step the last stage's loss and
    the calls the stage made into torch.distributed are kept, after the last its parameters."""
    s = dist.get_rank()
    tied_group = dist.new_group([0, P - 1])  # every rank makes it
    out = {}
    for m in ms:
        model = build_lab_model(
            PIPE_CFG, seed=50, device=parlab.device()
        )  # every rank builds it; stage s uses its part
        x, y = pipe_data(m)
        inputs = iter(x.chunk(len(x) // PIPE_B)) if s == 0 else iter(())  # the loader: micro-batches [b, T]
        targets = iter(y.chunk(len(y) // PIPE_B)) if s == P - 1 else iter(())
        stage = Stage(model, s, m, inputs, targets, tied_group)
        mine = stage_parameters(model, s)
        steps = []
        for _ in range(PIPE_STEPS):
            stage.loss, stage.most_held = 0.0, 0
            with probe.recording(keep_sent_data=False, with_groups=True) as calls, library_calls(LIBRARY) as called:
                one_f_one_b(stage, m)
            with torch.no_grad():
                for p in mine.values():
                    p -= PIPE_LR * (p.grad if p.grad is not None else 0.0)
            model.zero_grad(set_to_none=True)
            messages = [[c["op"], int(c["peer"]), len(c["group"]), int(c["bytes"])] for c in calls]
            steps.append({"loss": stage.loss, "calls": messages, "held": stage.most_held, "library": called})
        out[m] = {"steps": steps, "params": {n: p.detach().clone() for n, p in mine.items()}}
    return out


def collect_pipeline_m(one_f_one_b) -> dict:
    """One launch per group of PIPE_LAUNCHES, so that a hang (stopped within seconds, each rank's call named) leaves
    the other launch's results: {m: each rank's steps, or the error in a line}."""
    runs: dict[int, list | str] = {}
    for ms in PIPE_LAUNCHES:
        try:
            ranks = list(parlab.launch(run_1f1b, P, one_f_one_b, ms, **PIPELINE_LAUNCH))
            runs.update({m: [res[m] for res in ranks] for m in ms})
        except (RankError, LaunchTimeout) as exc:  # a hang, or a rank that raised: the verdict names it
            runs.update({m: error_summary(exc) for m in ms})
    return {"runs": runs}


def pipe_single_device(m: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One device on each step's batch (its m micro-batches; the mean over the batch), then SGD: each step's loss,
    and each stage's parameters after the last step."""
    x, y = pipe_data(m)
    model = build_lab_model(PIPE_CFG, seed=50)
    losses = []
    for step in range(PIPE_STEPS):
        rows = slice(step * m * PIPE_B, (step + 1) * m * PIPE_B)
        loss = lab_loss(model(x[rows]), y[rows])
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= PIPE_LR * p.grad
                p.grad = None
    return losses, [{n: p.detach().clone() for n, p in stage_parameters(model, s).items()} for s in range(P)]


def _count(calls: list, op: str, peer: int, nbytes: int) -> int:
    return sum(1 for c in calls if c[0] == op and c[1] == peer and c[3] == nbytes)


def _wrong_messages(ranks, m: int) -> str:
    """'' when every stage, in every step, sent m activations to s+1 and m gradients to s-1 (as many received), and
    the first and the last stage all-reduced the tied matrix's gradient once between them; nothing else."""
    act = PIPE_B * PIPE_CFG.seq_len * PIPE_CFG.hidden * 8
    tied = PIPE_CFG.vocab_size * PIPE_CFG.hidden * 8
    for step in range(PIPE_STEPS):
        for s in range(P):
            calls = ranks[s]["steps"][step]["calls"]
            want = {q: m for q in (s - 1, s + 1) if 0 <= q < P}
            sent = {q: _count(calls, "send", q, act) for q in want}
            received = {q: _count(calls, "recv", q, act) for q in want}
            sums = [c for c in calls if c[0] in ALL_REDUCE and c[2] == 2 and c[3] == tied]
            others = len(calls) - sum(sent.values()) - sum(received.values()) - len(sums)
            if sent != want or received != want:
                got = ", ".join(f"{sent[q]} sent to stage {q}" for q in want)
                return f"step {step + 1}, stage {s}: expected {m} sent to each neighbour, received {got}"
            if len(sums) != (s in (0, P - 1)):
                wanted = "1" if s in (0, P - 1) else "no"
                got = len(sums)
                return f"step {step + 1}, stage {s}: expected {wanted} all-reduce of the tied gradient, received {got}"
            if others:
                return f"step {step + 1}, stage {s}: expected nothing else, received {others} other calls"
    return ""


def _too_many_held(ranks, m: int) -> str:
    """'' when, in every step, every stage s held the activations of at most min(p - s, m) micro-batches at once
    (1F1B's memory: p - s warm-up and steady-state forwards in flight, never all m as GPipe holds them); else the
    first stage and step that held more, with both counts."""
    for step in range(PIPE_STEPS):
        for s in range(P):
            most, held = min(P - s, m), ranks[s]["steps"][step].get("held")
            if not isinstance(held, int) or held > most:
                return f"step {step + 1}, stage {s}: expected at most {most} held, received {held}"
    return ""


def judge_pipeline_m(data) -> list[str]:
    runs, lines, called, unknown = data["runs"], [], [], []
    for ms in PIPE_LAUNCHES:
        if isinstance(runs[ms[0]], str):  # it hung, or a rank raised: which m, the diagnosis says
            which = " and ".join(f"m={m}" for m in ms) + (" (one launch)" if len(ms) > 1 else "")
            lines.append(f"{which}: every stage finishes each step: {runs[ms[0]]}: FAIL")
            unknown += ms
    for m in PIPE_MS:
        ranks = runs[m]
        if isinstance(ranks, str):
            continue
        lines.append(f"m={m}: every stage finishes each step: PASS")
        losses, params = pipe_single_device(m)
        got = [step["loss"] for step in ranks[P - 1]["steps"]]
        lines.append(curve_line(f"m={m}: the loss of each of {PIPE_STEPS} steps (last stage)", got, losses))
        what = f"m={m}: every stage's parameters after {PIPE_STEPS} steps"
        lines.append(compare(what, [res["params"] for res in ranks], params).line)
        wrong = _wrong_messages(ranks, m)
        what = f"m={m}: every stage's messages in each step (m each way, the tied gradient summed once, nothing else)"
        lines.append(f"{what}: {f'{wrong}: FAIL' if wrong else 'PASS'}")
        many = _too_many_held(ranks, m)
        what = f"m={m}: activations each stage holds at once (1F1B: stage s at most min(p - s, m) micro-batches)"
        lines.append(f"{what}: {f'{many}: FAIL' if many else 'PASS'}")
        called += [c for res in ranks for step in res["steps"] for c in step["library"]]
    if unknown:  # the ranks that did not finish never said what they called
        ms = ", ".join(str(m) for m in unknown)
        what = "one_f_one_b: no call into the library's implementation of the scheme"
        lines.append(f"{what}: not known for m={ms}, whose ranks did not finish: FAIL")
    else:
        lines.append(library_verdict("one_f_one_b", called))
    return lines
