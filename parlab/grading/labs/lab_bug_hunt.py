"""The bug hunt's checks: six broken pieces of distributed training code, each run on live ranks and compared
with one device (float64), with what the ranks communicated watched at the process group or on parlab's trace.

Every rank function here is the working surroundings of one small function from the notebook (the student's):
the model, the data, the single-device reference and the verdicts live here, the code under suspicion in the
notebook's ANSWER cells.

The sizes of every part and the shared helpers are in lab_bug_hunt_setup.py; parts 5 and 6 (point-to-point code)
are at the end of this file.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import parlab
from parlab.core import comm, probe
from parlab.core.check import check_equal, compare
from parlab.core.models import causal_attention
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.lab_bug_hunt_setup import (
    B_DP,
    B_ZERO,
    BATCH,
    FFN,
    HEADS,
    HID,
    HS,
    IN,
    LAUNCH,
    OUT,
    P_PREDICT,
    PIPE_B,
    PIPE_H,
    PIPE_M,
    PIPELINE_LAUNCH,
    RING_C,
    T_TP,
    ZERO_LR,
    ZERO_SIZES,
    ZERO_STEPS,
    ZIGZAG_T,
    H,
    M,
    P,
    _grads,
    _no_error,
    _randn,
    attention_problem,
    mlp,
)
from parlab.schemes.sequence.ring_attention import RingAttention, ring_attention
from parlab.schemes.zero.stages import adam_step

STRUCTURAL = {
    "dp_accumulation": "every rank ends with one device's gradient of the global batch; the bytes each rank "
    "all-reduces in one step (M = 2) equal one copy of the gradients; no other collective",
    "tp_backward": "Megatron's MLP on 4 ranks: y, dL/dx and every weight's gradient match one device; the bytes "
    "each rank communicates in forward and in backward equal one [B, T, H] each",
    "zigzag_padding": "for T = 16 and T = 19 on 4 ranks: each rank's zigzag block has the theory's number of "
    "tokens; the library's ring attention on the blocks gives one device's causal attention and its gradients",
    "zero_padding": "3 Adam steps on 4 ranks with Psi = 103 (not divisible by 4): every parameter matches one "
    "device; the state elements each rank holds and the bytes it reduce-scatters and all-gathers per step equal "
    "the theory's (equal shards, nothing replicated); no all-reduce",
    "zero_sizes": "predictions for Psi = 103 on 7 ranks: the elements the handed-out step never updates, the "
    "shard size and the padding of a correct step (exact)",
    "pipeline_deadlock": "1F1B on 4 stages finishes (a hang fails within seconds), with one device's gradients "
    "and loss; every steady-state exchange makes one send and one receive through parlab.core.comm, both in flight "
    "at once (posted before either is waited for): a fix that orders them by rank parity fails here",
    "ring_lse": "the library's ring-attention backward on the forward's (out, lse): out and dq, dk, dv match "
    "one device's causal attention; the forward sends P-1 K/V blocks per rank",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# --------------------------------------------------------------------------- part 1: data parallel, accumulation


def dp_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: x [B, IN], y [B, OUT]."""
    return _randn(B_DP, IN, seed=11), _randn(B_DP, OUT, seed=12)


def run_dp(train_step) -> dict:
    """Rank code: rank r's rows of the batch through `train_step` (your code), the process group watched."""
    r = dist.get_rank()
    model = mlp((IN, HID, OUT), seed=10)  # the same weights on every rank
    x, y = dp_data()
    b = B_DP // P
    with probe.recording(keep_sent_data=False) as calls:
        train_step(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b], M)  # rows [r b, (r+1) b)
    return {"grads": _grads(model), "calls": calls}


def collect_dp_accumulation(train_step) -> dict:
    return {"ranks": list(parlab.launch(run_dp, P, train_step, **LAUNCH))}


def judge_dp_accumulation(data) -> list[str]:
    model = mlp((IN, HID, OUT), seed=10)
    x, y = dp_data()
    F.mse_loss(model(x), y).backward()  # one device, the whole batch
    reference, psi = _grads(model), sum(p.numel() for p in model.parameters())
    ranks = data["ranks"]
    lines = [compare(f"rank {r}: gradients after the step", ranks[r]["grads"], reference).line for r in range(P)]
    for r in range(P):
        calls = ranks[r]["calls"]
        reduced = probe.total_bytes(calls, "allreduce")
        others = len([c for c in calls if c["op"] != "allreduce"])
        lines.append(
            check_equal(f"rank {r}: bytes all-reduced in one step (M = {M} micro-batches)", reduced, psi * 8).line
        )
        lines.append(check_equal(f"rank {r}: calls of other collectives", others, 0).line)
    return lines


# ---------------------------------------------------------------------- part 2: tensor parallel, Megatron's f, g


def tp_problem() -> dict[str, torch.Tensor]:
    """The full MLP and data: x [B, T, H], fc [FFN, H] + [FFN], proj [H, FFN] + [H], the output gradient G."""
    return {
        "x": _randn(BATCH, T_TP, H, seed=21),
        "fc_w": _randn(FFN, H, seed=22) / math.sqrt(H),
        "fc_b": _randn(FFN, seed=23) / 4,
        "proj_w": _randn(H, FFN, seed=24) / math.sqrt(FFN),
        "proj_b": _randn(H, seed=25) / 4,
        "G": _randn(BATCH, T_TP, H, seed=26),
    }


def tp_mlp(x, fc_w, fc_b, proj_w, proj_b, f, g):
    """Megatron's MLP on this rank's slices: y = g(gelu(f(x) fc_w_r^T + fc_b_r) proj_w_r^T) + proj_b."""
    h = F.gelu(F.linear(f.apply(x), fc_w, fc_b))  # [B, T, FFN/P]: this rank's FFN units (column-parallel fc)
    return g.apply(F.linear(h, proj_w)) + proj_b  # [B, T, H]: the partial sums summed by g (row-parallel proj)


def run_tp(f, g) -> dict:
    """Rank code: rank r holds FFN units [r k, (r+1) k), k = FFN/P: rows of fc, columns of proj."""
    r, k = dist.get_rank(), FFN // P
    full = tp_problem()
    mine = {
        "x": full["x"].clone(),  # replicated
        "fc_w": full["fc_w"][r * k : (r + 1) * k].clone(),  # [k, H]
        "fc_b": full["fc_b"][r * k : (r + 1) * k].clone(),  # [k]
        "proj_w": full["proj_w"][:, r * k : (r + 1) * k].clone(),  # [H, k]
        "proj_b": full["proj_b"].clone(),  # [H], replicated: added once, after g
    }
    for t in mine.values():
        t.requires_grad_()
    with probe.recording(keep_sent_data=False) as forward_calls:
        y = tp_mlp(mine["x"], mine["fc_w"], mine["fc_b"], mine["proj_w"], mine["proj_b"], f, g)
    with probe.recording(keep_sent_data=False) as backward_calls:
        (y * full["G"]).sum().backward()
    grads = {name: t.grad for name, t in mine.items()}
    return {"y": y.detach(), "grads": grads, "forward": forward_calls, "backward": backward_calls}


def tp_single_device() -> dict:
    full = {name: t.requires_grad_() for name, t in tp_problem().items() if name != "G"}
    y = F.linear(F.gelu(F.linear(full["x"], full["fc_w"], full["fc_b"])), full["proj_w"], full["proj_b"])
    (y * tp_problem()["G"]).sum().backward()
    return {"y": y.detach(), "grads": {name: t.grad for name, t in full.items()}}


def collect_tp_backward(f, g) -> dict:
    return {"ranks": list(parlab.launch(run_tp, P, f, g, **LAUNCH))}


def judge_tp_backward(data) -> list[str]:
    ranks, ref = data["ranks"], tp_single_device()
    grads = [res["grads"] for res in ranks]
    gathered, error = _no_error(
        "gradients of the ranks' slices",
        lambda: {
            "fc_w": torch.cat([g["fc_w"] for g in grads], dim=0),  # the ranks' rows stacked: [FFN, H]
            "fc_b": torch.cat([g["fc_b"] for g in grads], dim=0),  # [FFN]
            "proj_w": torch.cat([g["proj_w"] for g in grads], dim=1),  # the ranks' columns side by side: [H, FFN]
            "proj_b": grads[0]["proj_b"],  # rank 0's
            "x": grads[0]["x"],
        },
    )
    if gathered is None:
        return error
    ratios = ", ".join(f"{name} {(gathered[name].norm() / ref['grads'][name].norm()).item():.3f}" for name in gathered)
    lines = [f"gradient norms / one device's: {ratios}"]  # information, not a verdict
    lines += [compare(f"rank {r}: y", ranks[r]["y"], ref["y"]).line for r in range(P)]
    for name, what in [
        ("fc_w", "dL/dW of fc, the ranks' rows stacked"),
        ("fc_b", "dL/db of fc, the ranks' pieces stacked"),
        ("proj_w", "dL/dW of proj, the ranks' columns side by side"),
    ]:
        lines.append(compare(what, gathered[name], ref["grads"][name]).line)
    for name, what in [("proj_b", "dL/db of proj"), ("x", "dL/dx")]:
        theirs, ours = [g[name] for g in grads], [ref["grads"][name]] * P
        lines.append(compare(f"{what}, on every rank", theirs, ours).line)
    y_bytes = BATCH * T_TP * H * 8
    for r in range(P):
        for phase in ("forward", "backward"):
            sent = sum(int(c["bytes"]) or 1 for c in ranks[r][phase])  # every call; a barrier counts one byte
            lines.append(check_equal(f"rank {r}: bytes communicated in {phase}", sent, y_bytes).line)
    return lines


# ------------------------------------------------------------------------- part 3: zigzag, T not divisible by 2P


def zigzag_unshard(blocks: list[torch.Tensor], T: int) -> torch.Tensor:
    """The ranks' zigzag blocks back in sequence order, cut to the T real tokens: [1, HEADS, T, HS].

    blocks[r] holds chunks r and 2P-1-r of the 2P chunks (its first half, then its second half)."""
    pieces: list[torch.Tensor | None] = [None] * (2 * len(blocks))
    for r, block in enumerate(blocks):
        pieces[r], pieces[2 * len(blocks) - 1 - r] = block.chunk(2, dim=-2)
    return torch.cat(pieces, dim=-2)[..., :T, :]


def run_zigzag(zigzag_shard) -> dict:
    """Rank code: for each T, every rank shards the whole q, k, v and G with `zigzag_shard` (your code), runs the
    library's ring attention (zigzag layout, causal) on its block and backpropagates sum(out_r * G_r)."""
    r = dist.get_rank()
    out = {}
    for T in ZIGZAG_T:
        q, k, v, g = attention_problem(T, seed=30 + T)
        for t in (q, k, v):
            t.requires_grad_()
        q_r, k_r, v_r = (zigzag_shard(t, r, P) for t in (q, k, v))  # [1, HEADS, 2c, HS] each
        o_r = ring_attention(q_r, k_r, v_r, causal=True, layout="zigzag")
        (o_r * zigzag_shard(g, r, P)).sum().backward()  # q.grad: this rank's part of dL/dq (summed over ranks)
        out[T] = {"out": o_r.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return out


def _summed(per_rank: list[dict]) -> list[torch.Tensor]:
    """dL/dq, dL/dk, dL/dv: the sum of the ranks' shares (each rank's backward reaches only its own tokens)."""
    return [sum(res[name] for res in per_rank) for name in ("dq", "dk", "dv")]


def collect_zigzag_padding(zigzag_shard) -> dict:
    return {"ranks": list(parlab.launch(run_zigzag, P, zigzag_shard, **LAUNCH))}


def judge_zigzag_padding(data) -> list[str]:
    ranks, lines = data["ranks"], []
    for T in ZIGZAG_T:
        q, k, v, g = (t.requires_grad_() for t in attention_problem(T, seed=30 + T))
        reference = causal_attention(q, k, v)  # one device, the whole sequence
        (reference * g.detach()).sum().backward()
        c = math.ceil(T / (2 * P))
        lengths = [int(ranks[r][T]["out"].shape[-2]) for r in range(P)]
        lines.append(f"T={T}: tokens in each rank's block: {lengths}")  # information
        for r in range(P):
            lines.append(check_equal(f"T={T}: rank {r}: tokens in its block", lengths[r], 2 * c).line)
        merged, error = _no_error(
            f"T={T}: the blocks back in order", zigzag_unshard, [ranks[r][T]["out"] for r in range(P)], T
        )
        if merged is None:
            lines += error
        else:
            lines.append(compare(f"T={T}: attention output, blocks back in order", merged, reference.detach()).line)
        what = f"T={T}: dL/dq, dL/dk, dL/dv (each rank's share, summed)"
        grads, error = _no_error(what, _summed, [ranks[r][T] for r in range(P)])
        lines += error or [compare(what, grads, [q.grad, k.grad, v.grad]).line]
    return lines


# ----------------------------------------------------------------------------- part 4: ZeRO, Psi not divisible by P


def zero_data() -> tuple[torch.Tensor, torch.Tensor]:
    return _randn(B_ZERO, ZERO_SIZES[0], seed=41), _randn(B_ZERO, ZERO_SIZES[-1], seed=42)


def flat_mlp(seed: int = 40) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The MLP whose parameters and gradients are views of two flat buffers of Psi numbers (no padding):
    flat_param (writing it writes the parameters) and flat_grad (backward accumulates into it)."""
    model = mlp(ZERO_SIZES, seed)
    psi = sum(p.numel() for p in model.parameters())
    flat_param, flat_grad = torch.zeros(psi, dtype=torch.float64), torch.zeros(psi, dtype=torch.float64)
    offset = 0
    for p in model.parameters():
        n = p.numel()
        flat_param[offset : offset + n] = p.detach().reshape(-1)
        p.data = flat_param[offset : offset + n].view_as(p)
        p.grad = flat_grad[offset : offset + n].view_as(p)
        offset += n
    return model, flat_param, flat_grad


def run_zero(zero_update) -> dict:
    """Rank code: ZERO_STEPS steps of ZeRO (stage 2's communication) with `zero_update` (your code), each rank on
    its rows of the batch; the last step's calls into torch.distributed are recorded."""
    r = dist.get_rank()
    model, flat_param, flat_grad = flat_mlp()
    x, y = zero_data()
    b = B_ZERO // P
    state: dict = {}  # this rank's optimizer state, kept by zero_update from step to step
    for step in range(1, ZERO_STEPS + 1):
        flat_grad.zero_()
        F.mse_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()  # flat_grad: my rows' gradient
        with probe.recording(keep_sent_data=False) as calls:
            zero_update(flat_param, flat_grad, state, step)
    held = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "held": held, "calls": calls}


def zero_single_device() -> dict[str, torch.Tensor]:
    """Adam (parlab.schemes.zero.stages.adam_step, torch's arithmetic) on one device, on the whole batch."""
    model, flat_param, flat_grad = flat_mlp()
    x, y = zero_data()
    master, m, v = flat_param.clone(), torch.zeros_like(flat_param), torch.zeros_like(flat_param)
    for step in range(1, ZERO_STEPS + 1):
        flat_grad.zero_()
        F.mse_loss(model(x), y).backward()
        adam_step(master, flat_grad, m, v, step, ZERO_LR)
        flat_param.copy_(master)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def collect_zero_padding(zero_update) -> dict:
    return {"ranks": list(parlab.launch(run_zero, P, zero_update, **LAUNCH))}


def _unchanged(params: dict, initial: dict) -> str:
    """ "2.bias 3 of 3" for the parameters with elements still at their initial value (information)."""
    found = []
    for name, start in initial.items():
        mine = params.get(name)
        if isinstance(mine, torch.Tensor) and mine.shape == start.shape and (same := int((mine == start).sum())):
            found.append(f"{name} {same} of {start.numel()}")
    return ", ".join(found) or "none"


def judge_zero_padding(data) -> list[str]:
    ranks, reference = data["ranks"], zero_single_device()
    psi = sum(t.numel() for t in reference.values())
    S = math.ceil(psi / P)
    initial = {n: p.detach() for n, p in flat_mlp()[0].named_parameters()}
    lines = [f"rank 0: elements still at their initial value: {_unchanged(ranks[0]['params'], initial)}"]
    lines += [
        compare(f"rank {r}: parameters after {ZERO_STEPS} steps", ranks[r]["params"], reference).line for r in range(P)
    ]
    for r in range(P):
        calls = ranks[r]["calls"]
        lines += [
            check_equal(
                f"rank {r}: optimizer state elements held (master, m, v)",
                ranks[r]["held"],
                3 * S,
            ).line,
            check_equal(
                f"rank {r}: bytes reduce-scattered into its gradient shard",
                probe.total_bytes(calls, "reduce_scatter_single"),
                S * 8,
            ).line,
            check_equal(
                f"rank {r}: bytes of the all-gathered parameters",
                probe.total_bytes(calls, "all_gather_single"),
                P * S * 8,
            ).line,
            check_equal(f"rank {r}: all-reduces", sum(c["op"] == "allreduce" for c in calls), 0).line,
        ]
    return lines


def collect_zero_sizes(predictions: dict) -> dict:
    """The predictions as plain data (numbers as floats; anything else as its text, which fails)."""
    out = {}
    for name in ("frozen", "shard", "padding"):
        value = predictions.get(name) if isinstance(predictions, dict) else None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        out[name] = value if isinstance(value, (int, float)) else str(value)[:40]
    return out


def judge_zero_sizes(data) -> list[str]:
    psi = sum(p.numel() for p in mlp(ZERO_SIZES, 40).parameters())
    S = math.ceil(psi / P_PREDICT)
    theory = {"frozen": psi % P_PREDICT, "shard": S, "padding": P_PREDICT * S - psi}
    labels = {
        "frozen": f"elements of flat_param the handed-out step never changes (Psi = {psi}, P = {P_PREDICT})",
        "shard": f"elements of each rank's master shard in a correct step (P = {P_PREDICT})",
        "padding": f"elements beyond Psi in the tensor a correct step reduce-scatters (P = {P_PREDICT})",
    }
    lines = []
    for name in ("frozen", "shard", "padding"):
        lines += prediction_lines(labels[name], data[name], theory[name], rtol=0)
    return lines


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
    lines = [compare("loss of the step (last stage)", ranks[P - 1]["loss"], loss.item()).line]
    for s in range(P):
        reference = _grads(model[2 * s : 2 * s + 2])
        lines.append(compare(f"stage {s}: weight and bias gradients", ranks[s]["grads"], reference).line)
    for s in range(P):
        steady = PIPE_M - min(P - s - 1, PIPE_M)  # steady-state steps of stage s
        expected = (steady if s < P - 1 else 0) + (steady - 1 if s > 0 else 0)  # calls of the two exchanges
        exchanges = ranks[s]["exchanges"]
        good = sum(_overlapped(e["events"], e["peer"]) for e in exchanges)
        what = (
            f"stage {s}: exchanges with their send and receive in flight at once "
            "(required: a link carries both directions at the same time)"
        )
        lines.append(check_equal(what, good, expected).line)
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
    """The library's ring attention (parlab.schemes.sequence.ring_attention.RingAttention), causal, contiguous layout,
    with your forward in place of its own: its backward gets the (q, k, v, out, lse) your forward returns."""

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
    sent = sum(e.bytes for e in comm.trace_events() if e.kind == "send")  # in forward, traced by parlab.core.comm
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
        lines.append(compare(f"{what}, the ranks' blocks in order", side_by_side, ref).line)
    block = 2 * HEADS * RING_C * HS * 8  # one K/V block [2, 1, HEADS, c, HS]
    for r in range(P):
        sent = ranks[r]["sent"]
        lines.append(check_equal(f"rank {r}: bytes sent in forward (P-1 K/V blocks)", sent, (P - 1) * block).line)
    return lines
