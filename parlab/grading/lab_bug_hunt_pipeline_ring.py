"""The bug hunt's parts 5 and 6, point-to-point code: a pipeline's send/recv exchange (pipeline_deadlock) and
ring attention's forward with its lse (ring_lse)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import parlab
from parlab import comm
from parlab.check import check_equal, compare
from parlab.grading.lab_bug_hunt_setup import (
    HEADS,
    HS,
    LAUNCH,
    PIPE_B,
    PIPE_H,
    PIPE_M,
    PIPELINE_LAUNCH,
    RING_C,
    P,
    _grads,
    _randn,
    attention_problem,
    mlp,
)
from parlab.models import causal_attention
from parlab.ring_attention import RingAttention

# --------------------------------------------------------------------------- part 5: pipeline, send/recv order


def pipe_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: x, y [PIPE_M * PIPE_B, PIPE_H]; micro-batch i is rows [i b, (i+1) b)."""
    return _randn(PIPE_M * PIPE_B, PIPE_H, seed=51), _randn(PIPE_M * PIPE_B, PIPE_H, seed=52)


def pipe_model() -> nn.Sequential:
    """The whole model on one device: P stages, each Linear(H, H) then tanh. Stage s is layers [2s, 2s+2)."""
    layers: list[nn.Module] = []
    for s in range(P):
        layers += [mlp((PIPE_H, PIPE_H), seed=53 + 2 * s), nn.Tanh()]
    return nn.Sequential(*layers)


def run_1f1b(send_forward_recv_backward, send_backward_recv_forward) -> dict:
    """Rank code: stage s = rank s runs Megatron's 1F1B (non-interleaved) over PIPE_M micro-batches.

    Warm-up and cool-down use plain blocking comm.send / comm.recv; the steady state uses your two exchange
    functions; each call of them is recorded (the traced sends and receives it made)."""
    s = dist.get_rank()
    first, last = s == 0, s == P - 1
    stage = pipe_model()[2 * s : 2 * s + 2]  # this rank's layers
    xs, ys = (t.chunk(PIPE_M) for t in pipe_data())  # PIPE_M micro-batches of [b, H]
    shape = (PIPE_B, PIPE_H)
    fed, exchanges, loss_total = iter(range(PIPE_M)), [], 0.0
    held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, output) of micro-batches awaiting backward

    def recv_forward():
        if first:
            return xs[next(fed)].clone()
        x = torch.empty(shape, dtype=torch.float64)
        comm.recv(x, s - 1)
        return x

    def forward(x):
        nonlocal loss_total
        x.requires_grad_(not first)
        out = stage(x)
        if last:  # the loss of micro-batch i, scaled so that the m losses add up to the batch's mean
            out = F.mse_loss(out, ys[len(held) + done[0]]) / PIPE_M
            loss_total += out.item()
        held.append((x, out))
        return out

    def backward(grad):
        x, out = held.pop(0)
        torch.autograd.backward(out, grad)
        done[0] += 1
        return None if first else x.grad

    def recorded(fn, *args):  # one exchange: the peer it was for, and every traced call it made
        before = len(comm.trace_events())
        fn(*args)
        events = [(e.kind, e.peer, e.bytes, e.start, e.end) for e in comm.trace_events()[before:]]
        exchanges.append({"peer": args[-1], "events": events})

    done = [0]  # micro-batches whose backward is done (the last stage's targets are ys[i])
    warmup = min(P - s - 1, PIPE_M)
    for _ in range(warmup):
        out = forward(recv_forward())
        comm.send(out.detach(), s + 1)  # warm-up: forward only
    x = recv_forward() if PIPE_M > warmup else None
    for i in range(PIPE_M - warmup):  # steady state: one forward, one backward
        out = forward(x)
        grad = None
        if not last:  # send this output on, receive the gradient of the oldest output held
            grad = torch.empty(shape, dtype=torch.float64)
            recorded(send_forward_recv_backward, out.detach(), grad, s + 1)
        grad_x = backward(grad)
        if i == PIPE_M - warmup - 1:
            if not first:
                comm.send(grad_x, s - 1)
        elif first:
            x = recv_forward()
        else:  # send the input's gradient back, receive the next micro-batch's input
            x = torch.empty(shape, dtype=torch.float64)
            recorded(send_backward_recv_forward, grad_x, x, s - 1)
    for _ in range(warmup):  # cool-down: backward only
        grad = torch.empty(shape, dtype=torch.float64)
        comm.recv(grad, s + 1)
        grad_x = backward(grad)
        if not first:
            comm.send(grad_x, s - 1)
    return {"grads": _grads(stage), "loss": loss_total, "exchanges": exchanges}


def collect_pipeline_deadlock(send_forward_recv_backward, send_backward_recv_forward) -> dict:
    results = parlab.launch(run_1f1b, P, send_forward_recv_backward, send_backward_recv_forward, **PIPELINE_LAUNCH)
    return {"ranks": list(results)}


def _overlapped(exchange, peer: int) -> bool:
    """One send to `peer` and one receive from it, of one [b, H] each, the two in flight at the same time."""
    nbytes = PIPE_B * PIPE_H * 8
    sends = [e for e in exchange if e[0] == "send" and e[1] == peer and e[2] == nbytes]
    recvs = [e for e in exchange if e[0] == "recv" and e[1] == peer and e[2] == nbytes]
    if len(exchange) != 2 or len(sends) != 1 or len(recvs) != 1:
        return False
    (_, _, _, s0, s1), (_, _, _, r0, r1) = sends[0], recvs[0]
    s1, r1 = math.inf if s1 is None else s1, math.inf if r1 is None else r1  # never waited for: still in flight
    return s0 < r1 and r0 < s1


def judge_pipeline_deadlock(data) -> list[str]:
    ranks = data["ranks"]
    model = pipe_model()
    x, y = pipe_data()
    loss = F.mse_loss(model(x), y)  # the mean over the batch: the m micro-batch losses / m add up to it
    loss.backward()
    lines = [compare("loss of the step (last stage)", ranks[P - 1]["loss"], loss.item(), show=False).line]
    for s in range(P):
        reference = _grads(model[2 * s : 2 * s + 2])
        lines.append(compare(f"stage {s}: weight and bias gradients", ranks[s]["grads"], reference, show=False).line)
    for s in range(P):
        steady = PIPE_M - min(P - s - 1, PIPE_M)  # steady-state steps of stage s
        expected = (steady if s < P - 1 else 0) + (steady - 1 if s > 0 else 0)  # calls of the two exchanges
        exchanges = ranks[s]["exchanges"]
        good = sum(_overlapped(e["events"], e["peer"]) for e in exchanges)
        what = (
            f"stage {s}: exchanges with their send and receive in flight at once "
            "(required: a link carries both directions at the same time)"
        )
        lines.append(check_equal(what, good, expected, show=False).line)
    return lines


# ---------------------------------------------------------------------- part 6: ring attention's forward, lse


def pass_on(block: torch.Tensor):
    """Start sending `block` to rank r+1 and receiving rank r-1's block into a new buffer: (incoming, works);
    comm.wait_all(works) before reading `incoming` (or reusing `block`)."""
    r = comm.group_rank()
    incoming = torch.empty_like(block)
    works = [comm.irecv(incoming, (r - 1) % P), comm.isend(block, (r + 1) % P)]
    return incoming, works


class _RingWithYourForward(torch.autograd.Function):
    """The library's ring attention (parlab.ring_attention.RingAttention), causal, contiguous layout, with your
    forward in place of its own: its backward gets the (q, k, v, out, lse) your forward returns."""

    @staticmethod
    def forward(ctx, q, k, v, ring_forward):
        out, lse = ring_forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.layout, ctx.label = True, None, "contiguous", ""
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = RingAttention.backward(ctx, dout)[:3]  # the library's: each tile's softmax from lse
        return dq, dk, dv, None


def run_ring(ring_forward) -> dict:
    """Rank code: rank r holds tokens [r c, (r+1) c) of q, k, v; backpropagates sum(out_r * G_r)."""
    r, c = dist.get_rank(), RING_C
    q, k, v, g = (t[..., r * c : (r + 1) * c, :].clone() for t in attention_problem(P * c, seed=60))
    for t in (q, k, v):
        t.requires_grad_()
    out = _RingWithYourForward.apply(q, k, v, ring_forward)  # [1, HEADS, c, HS]
    sent = sum(e.bytes for e in comm.trace_events() if e.kind == "send")  # in forward, traced by parlab.comm
    (out * g).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "sent": sent}


def collect_ring_lse(ring_forward) -> dict:
    return {"ranks": list(parlab.launch(run_ring, P, ring_forward, **LAUNCH))}


def judge_ring_lse(data) -> list[str]:
    ranks = data["ranks"]
    q, k, v, g = (t.requires_grad_() for t in attention_problem(P * RING_C, seed=60))
    reference = causal_attention(q, k, v)
    (reference * g.detach()).sum().backward()
    lines = []
    for name, ref in [("out", reference.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)]:
        what = "attention output" if name == "out" else f"dL/d{name[1]}"
        side_by_side = torch.cat([ranks[r][name] for r in range(P)], dim=-2)  # the ranks' tokens in order
        lines.append(compare(f"{what}, the ranks' blocks in order", side_by_side, ref, show=False).line)
    block = 2 * HEADS * RING_C * HS * 8  # one K/V block [2, 1, HEADS, c, HS]
    for r in range(P):
        sent = ranks[r]["sent"]
        lines.append(
            check_equal(f"rank {r}: bytes sent in forward (P-1 K/V blocks)", sent, (P - 1) * block, show=False).line
        )
    return lines
