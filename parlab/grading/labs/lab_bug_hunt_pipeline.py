"""The bug hunt, part 5: a 1F1B loop over the lab model's blocks, for any number m of micro-batches.

Each stage is one block of the lab model (stage 0 also embeds the tokens, the last stage applies the final norm,
the head and the loss). The student's function is the loop of one stage (Megatron's non-interleaved 1F1B: warm-up
forwards, one forward and one backward alternately, cool-down backwards); `Stage` hands it the stage's forward and
backward and its messages, the paired ones with both directions in flight together. Stage 0 takes its inputs from a
data loader that goes on into the next step, as a real one does; the last stage takes its targets from its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm
from parlab.core.check import compare
from parlab.core.lab_model import LabModel, build_lab_model, lab_batches, lab_loss
from parlab.grading.labs import error_summary
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab_bug_hunt_setup import (
    LIBRARY,
    PIPE_B,
    PIPE_CFG,
    PIPE_LAUNCHES,
    PIPE_MS,
    PIPE_STEPS,
    PIPELINE_LAUNCH,
    P,
    first_wrong,
    library_verdict,
)
from parlab.runtime.errors import LaunchTimeout, RankError


def pipe_data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's token ids for m micro-batches per step: x, y [(PIPE_STEPS[m] + 1) m PIPE_B, T], micro-batch i is
    rows [i b, (i+1) b); step k (from 0) uses micro-batches [k m, (k+1) m). One step more than the run takes."""
    x, y = lab_batches(PIPE_CFG, (PIPE_STEPS[m] + 1) * m * PIPE_B, 1, seed=51 + m)[0]
    return x.to(parlab.device()), y.to(parlab.device())


def stage_parameters(model: LabModel, s: int) -> dict[str, torch.Tensor]:
    """Stage s's parameters, by the model's names: block s; the embedding on stage 0; the final norm and the head on
    the last stage."""
    mine = (f"blocks.{s}.",) + (("embed.",) if s == 0 else ()) + (("norm.", "head.") if s == P - 1 else ())
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
    """

    def __init__(self, model: LabModel, s: int, m: int, inputs: Iterator[torch.Tensor], targets: Iterator):
        self.s, self.p, self.model, self.m = s, P, model, m
        self.first, self.last = s == 0, s == P - 1
        self.inputs, self.targets = inputs, targets
        self.positions = torch.arange(PIPE_CFG.seq_len, device=parlab.device())
        self.shape = (PIPE_B, PIPE_CFG.seq_len, PIPE_CFG.hidden)
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, output) awaiting backward, oldest first
        self.loss = 0.0

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=torch.float64, device=parlab.device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed(x) if self.first else x.requires_grad_()  # [b, T, H]
        out = self.model.blocks[self.s](h, self.positions)
        if self.last:  # this micro-batch's loss, / m: the m losses add up to the step's mean
            out = lab_loss(self.model.logits(out), next(self.targets)) / self.m
            self.loss += out.item()
        self.held.append((x, out))
        return out

    def backward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        x, out = self.held.pop(0)
        torch.autograd.backward(out, grad)
        return None if self.first else x.grad

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
    """Rank code: for each m of `ms`, stage s = rank s runs PIPE_STEPS[m] steps of `one_f_one_b(stage, m)` (your code)
    from the same weights; after each step its parameters' gradients, the last stage's loss and the messages the
    stage sent (parlab.core.comm's trace) are kept, and the gradients zeroed."""
    s = dist.get_rank()
    out = {}
    for m in ms:
        model = build_lab_model(PIPE_CFG, seed=50).to(parlab.device())  # every rank builds it; stage s uses its part
        x, y = pipe_data(m)
        inputs = iter(x.chunk(len(x) // PIPE_B)) if s == 0 else iter(())  # the loader: micro-batches [b, T]
        targets = iter(y.chunk(len(y) // PIPE_B)) if s == P - 1 else iter(())
        stage = Stage(model, s, m, inputs, targets)
        steps = []
        for _ in range(PIPE_STEPS[m]):
            stage.loss, before = 0.0, len(comm.trace_events())
            with library_calls(LIBRARY) as called:
                one_f_one_b(stage, m)
            sent = [[e.peer, e.bytes] for e in comm.trace_events()[before:] if e.kind == "send"]
            grads = {n: _grad_of(p) for n, p in stage_parameters(model, s).items()}
            steps.append({"grads": grads, "loss": stage.loss, "sent": sent, "library": called})
            model.zero_grad(set_to_none=True)
        out[m] = steps
    return out


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)


def collect_pipeline_m(one_f_one_b) -> dict:
    """One launch per group of PIPE_LAUNCHES, the last one (m = 2) alone, so that a hang there (stopped within
    seconds, each rank's call named) leaves the others' results: {m: each rank's steps, or the error in a line}."""
    runs: dict[int, list | str] = {}
    for ms in PIPE_LAUNCHES:
        try:
            ranks = list(parlab.launch(run_1f1b, P, one_f_one_b, ms, **PIPELINE_LAUNCH))
            runs.update({m: [res[m] for res in ranks] for m in ms})
        except (RankError, LaunchTimeout) as exc:  # a hang, or a rank that raised: the verdict names it
            runs.update({m: error_summary(exc) for m in ms})
    return {"runs": runs}


def _references(m: int) -> list[tuple[float, list[dict[str, torch.Tensor]]]]:
    """One device on each step's batch (its m micro-batches): the loss and each stage's gradients, step by step."""
    x, y = pipe_data(m)
    out = []
    for step in range(PIPE_STEPS[m]):
        model = build_lab_model(PIPE_CFG, seed=50)
        rows = slice(step * m * PIPE_B, (step + 1) * m * PIPE_B)
        loss = lab_loss(model(x[rows]), y[rows])  # the mean over the batch: the m micro-batch losses / m add up to it
        loss.backward()
        out.append((loss.item(), [{n: p.grad for n, p in stage_parameters(model, s).items()} for s in range(P)]))
    return out


def _wrong_messages(ranks, m: int) -> str:
    """'' when every stage sent, in every step, m activations to s+1 and m gradients to s-1 and nothing else."""
    nbytes = PIPE_B * PIPE_CFG.seq_len * PIPE_CFG.hidden * 8
    for step in range(PIPE_STEPS[m]):
        for s in range(P):
            sent = sorted(tuple(e) for e in ranks[s][step]["sent"])
            expected = sorted([(s + 1, nbytes)] * m * (s < P - 1) + [(s - 1, nbytes)] * m * (s > 0))
            if sent != expected:
                count = lambda msgs, peer: sum(1 for p, b in msgs if p == peer and b == nbytes)  # noqa: E731
                peers = [q for q in (s - 1, s + 1) if 0 <= q < P]
                got = ", ".join(f"{count(sent, q)} to stage {q}" for q in peers)
                want = ", ".join(f"{count(expected, q)} to stage {q}" for q in peers)
                extra = len(sent) - sum(count(sent, q) for q in peers)
                got += f", {extra} others" if extra else ""
                return f"step {step + 1}, stage {s}: expected {want} of {nbytes} bytes each, received {got}"
    return ""


def judge_pipeline_m(data) -> list[str]:
    runs, lines, called = data["runs"], [], []
    for m in PIPE_MS:
        ranks = runs[m]
        if isinstance(ranks, str):  # it hung, or a rank raised
            lines.append(f"m={m}: every stage finishes the step: {ranks}: FAIL")
            continue
        lines.append(f"m={m}: every stage finishes the step: PASS")
        for step, (loss, grads) in enumerate(_references(m)):
            what = f"m={m}, step {step + 1}: the loss (last stage)"
            lines.append(compare(what, ranks[P - 1][step]["loss"], loss).line)
            got = {f"stage {s}: {n}": g for s in range(P) for n, g in ranks[s][step]["grads"].items()}
            expected = {f"stage {s}: {n}": g for s in range(P) for n, g in grads[s].items()}
            lines.append(first_wrong(f"m={m}, step {step + 1}: every stage's gradients", got, expected))
        wrong = _wrong_messages(ranks, m)
        what = f"m={m}: every stage's messages in each step (m activations forward, m gradients back, nothing else)"
        lines.append(f"{what}: {f'{wrong}: FAIL' if wrong else 'PASS'}")
        called += [c for res in ranks for step in res for c in step["library"]]
    lines.append(library_verdict("one_f_one_b", called))
    return lines
