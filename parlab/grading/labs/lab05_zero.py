"""Lab 05's checks: ZeRO's three stages written by the student, on live ranks (see parlab/grading).

Every collective the student's code makes is seen where it reaches the process group (`recording`, in
lab05_recording.py), with its payload in parlab.core.comm's convention: an all-gather hands in this rank's contribution,
a reduce-scatter its whole input. A buffer of the wrong dtype or size is refused there with a sentence, before gloo
aborts on it. The setup (models, batches, N) is in lab05_setup.py, the prediction's check in lab05_traffic.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import parlab
from parlab.core.check import compare
from parlab.core.memory import tensor_bytes
from parlab.core.models import build_model, lm_loss
from parlab.core.probe import _tensors
from parlab.grading.labs import lab05_traffic, run_check
from parlab.grading.labs.lab05_recording import (
    SUMMED,
    _by_op,
    _compared,
    _dtype_line,
    _fraction,
    _is,
    _line,
    _scale,
    _shard,
    _verdict,
    one_thread,
    recording,
)
from parlab.grading.labs.lab05_setup import BATCHES, CFG, LAUNCH, LR, STEPS, WIDTHS, B, K, N, buckets_of
from parlab.schemes.data_parallel import shard_batch
from parlab.schemes.zero.stages import adam_step

# This lab's checks written in other files: the grader looks each one up here, then in these.
PARTS = (lab05_traffic,)

STRUCTURAL = {
    "zero1": "3 ranks, 2 Adam steps of the GPT from each rank's own rows: losses and parameters equal one device's; "
    "each rank's master weights and Adam m are its [S] slices of one device's, zero-padded to N S (S = ceil(Psi/N)); "
    "every step changes the model's own parameters; it holds K S bytes of optimizer state; per step exactly one "
    "reduce-scatter of the padded gradient [N S] and one all-gather of its [S] shard, nothing else, every buffer in "
    "the model's dtype",
    "zero2": "3 ranks, one backward of the GPT with a bucket per layer: each rank's gradient shards equal its slices "
    "of one device's (mean) gradient, padding zero; during backward exactly one reduce-scatter of [N S_b] per "
    "bucket, in the order backward completes the buckets, in the model's dtype; no .grad left after backward; the "
    "gradient memory held (live .grad tensors plus the shards) never exceeds the shards plus the largest bucket",
    "zero3_traffic": "the predicted number of collective calls (exactly) and payload bytes (within 5%) of rank 0 in "
    "one fp16, loss-scaled ZeRO-3 step on 2 ranks (a GPT of 3 blocks), against the theory and against "
    "parlab.schemes.zero.stages's measured run",
    "zero3": "3 ranks, an MLP of 3 layers whose weights exist only as [S_l] shards: outputs and gradient shards equal "
    "one device's; one all-gather per layer in forward, one all-gather and one reduce-scatter per layer in backward, "
    "in the model's dtype; the gathered weights are dropped after use (at most one layer's alive at a time, none "
    "between forward and backward), and nothing but activations and shards is kept for backward",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ---------------------------------------------------------------------------------------- part 1: ZeRO-1


def flat_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The reference GPT whose parameters and gradients are views of two flat buffers of Psi numbers (not padded):
    flat_param (writing it writes the parameters) and flat_grad (backward accumulates into it)."""
    model = build_model(CFG, seed=0)  # the same weights on every rank
    flat_param = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # [Psi]
    flat_grad = torch.zeros_like(flat_param)  # [Psi]
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.data = flat_param[offset : offset + n].view_as(p)
        p.grad = flat_grad[offset : offset + n].view_as(p)
        offset += n
    return model, flat_param, flat_grad


def train_zero1(init_shard, zero1_step, batches) -> dict:
    """Rank code: ZeRO-1 with your two functions. batches: the global batches, the same list on every rank."""
    P, r = dist.get_world_size(), dist.get_rank()
    model, flat_param, flat_grad = flat_model()
    state = init_shard(flat_param)  # rank r's master weights, m, v
    losses, calls, dtypes, moved = [], [], set(), []
    for step, (x, y) in enumerate(batches, start=1):
        flat_grad.zero_()
        x_r, y_r = shard_batch(x, y, r, P)  # [B/N, T]
        loss = lm_loss(model(x_r), y_r)  # the mean over this rank's rows
        loss.backward()  # flat_grad <- the gradient of this rank's rows [Psi]
        model_before, master_before = _params_of(model), state["master"].detach().clone()
        with recording() as seen:
            zero1_step(flat_param, flat_grad, state, step)
        moved.append([not _params_of(model).equal(model_before), not state["master"].equal(master_before)])
        losses.append(loss.item())
        calls.append(seen.calls)
        dtypes |= seen.dtypes
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "master": state["master"].detach().clone(),
        "m": state["m"].detach().clone(),
        "held": tensor_bytes(state),
        "calls": calls,
        "dtypes": sorted(dtypes),
        "moved": moved,  # per step: [did the model's parameters change, did the master weights change]
    }


def _params_of(model: nn.Module) -> torch.Tensor:
    """The parameters the model computes with, flat: [Psi] (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def single_device_adam(batches) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    """The reference: one device, the whole batch, Adam on all Psi parameters at once
    (parlab.schemes.zero.stages.adam_step is torch.optim.Adam's arithmetic, checked against it in tests/test_zero.py;
    torch.optim would import torch._dynamo, seconds of this notebook's budget). Returns the loss of each step, the final
    parameters and Adam's m [Psi]."""
    model = build_model(CFG, seed=0)
    params = list(model.parameters())
    master = torch.cat([p.detach().reshape(-1) for p in params])  # [Psi]
    m, v, losses = torch.zeros_like(master), torch.zeros_like(master), []
    for step, (x, y) in enumerate(batches, start=1):
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        adam_step(master, torch.cat([p.grad.reshape(-1) for p in params]), m, v, step, LR)
        torch.nn.utils.vector_to_parameters(master, params)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, m


def collect_zero1(init_shard, zero1_step) -> dict:
    return {"ranks": list(parlab.launch(train_zero1, N, init_shard, zero1_step, BATCHES, **LAUNCH))}


def judge_zero1(data) -> list[str]:
    ranks = data["ranks"]
    with one_thread():
        losses, params, m = single_device_adam(BATCHES)
    psi = sum(t.numel() for t in params.values())
    S = -(-psi // N)
    flat = torch.cat([t.reshape(-1) for t in params.values()])
    mean_loss = torch.stack([res["losses"] for res in ranks]).mean(dim=0)  # each rank's loss is over B/N rows
    lines = [
        _dtype_line(ranks),
        _moved_line(ranks),
        _compared(
            "every rank's Adam m: its slice of one device's m, zero-padded",
            [res["m"] for res in ranks],
            [_shard(m, r, N) for r in range(N)],
            SUMMED,
        ),
        compare("loss of each step, averaged over ranks", mean_loss, torch.tensor(losses, dtype=torch.float64)).line,
        compare(
            f"every rank's parameters after {STEPS} steps",
            [res["params"] for res in ranks],
            [params] * N,
        ).line,
        compare(
            "every rank's master weights: its slice of the parameters, zero-padded to N S",
            [res["master"] for res in ranks],
            [_shard(flat, r, N) for r in range(N)],
        ).line,
        _line("optimizer bytes each rank holds (K S)", [res["held"] for res in ranks], [K * S] * N),
    ]
    per_step = [["reduce_scatter", N * S * 8], ["all_gather", S * 8]]
    lines.append(_line("collectives [op, payload bytes] of rank 0's steps", ranks[0]["calls"], [per_step] * STEPS))
    same = [res["calls"] == [per_step] * STEPS for res in ranks[1:]]
    lines.append(_line(f"ranks 1-{N - 1}: the same collectives", same, [True] * (N - 1)))
    return lines


def _moved_line(ranks: list[dict]) -> str:
    """Every step changed the model's own parameters; if not, why (the master weights moved, or nothing did)."""
    replaced = sorted({r for r, res in enumerate(ranks) for model, master in res["moved"] if master and not model})
    idle = sorted({r for r, res in enumerate(ranks) for model, master in res["moved"] if not master and not model})
    if replaced:
        failing = (
            f"rank(s) {replaced}: the master weights moved but the model's parameters did not: flat_param was "
            "replaced, not written, so the model never saw the new values"
        )
    else:
        failing = f"rank(s) {idle}: a step changed neither the master weights nor the model's parameters"
    return _verdict(not (replaced or idle), "every step changed the model's own parameters, on every rank", failing)


# ---------------------------------------------------------------------------------------- part 2: ZeRO-2


def run_zero2(Zero2Grads, x, y) -> dict:
    """Rank code: one forward and backward of the GPT on this rank's rows, with your gradient hooks."""
    P, r = dist.get_world_size(), dist.get_rank()
    model = build_model(CFG, seed=0)
    params, yours, held = list(model.parameters()), [], []

    def observe(p):  # runs before your hook of the same parameter: what this rank holds as p's gradient lands
        live = [q.grad for q in params if q.grad is not None]
        held.append(tensor_bytes(live) + tensor_bytes(getattr(yours[0], "shards", []) if yours else []))

    for p in params:
        p.register_post_accumulate_grad_hook(observe)
    yours.append(Zero2Grads(buckets_of(model)))
    x_r, y_r = shard_batch(x, y, r, P)  # [B/N, T]
    loss = lm_loss(model(x_r), y_r)  # the mean over this rank's rows
    with recording() as seen:
        loss.backward()
    return {
        "shards": [s.detach().clone() for s in yours[0].shards],
        "calls": seen.calls,
        "dtypes": sorted(seen.dtypes),
        "grads_after": tensor_bytes([p.grad for p in params if p.grad is not None]),
        "peak": max(held),
    }


def collect_zero2(Zero2Grads) -> dict:
    return {"ranks": list(parlab.launch(run_zero2, N, Zero2Grads, *BATCHES[0], **LAUNCH))}


def _bucket_order(model: nn.Module, loss: torch.Tensor) -> list[int]:
    """The buckets in the order backward completes them (the same on every rank: the same graph)."""
    buckets, done = buckets_of(model), []
    left = [len(b) for b in buckets]
    where = {id(p): b for b, bucket in enumerate(buckets) for p in bucket}

    def arrived(p):
        left[where[id(p)]] -= 1
        if left[where[id(p)]] == 0:
            done.append(where[id(p)])

    hooks = [p.register_post_accumulate_grad_hook(arrived) for p in model.parameters()]
    loss.backward()
    for hook in hooks:
        hook.remove()
    return done


def judge_zero2(data) -> list[str]:
    ranks = data["ranks"]
    model = build_model(CFG, seed=0)
    with one_thread():
        order = _bucket_order(model, lm_loss(model(BATCHES[0][0]), BATCHES[0][1]))  # the mean over all B rows
    buckets = buckets_of(model)
    sizes = [sum(p.numel() for p in bucket) for bucket in buckets]  # Psi_b
    S = [-(-n // N) for n in sizes]  # S_b
    expected = [[_shard(torch.cat([p.grad.reshape(-1) for p in b]), r, N) for b in buckets] for r in range(N)]
    calls = [["reduce_scatter", N * S[b] * 8] for b in order]
    return [
        _dtype_line(ranks),
        _compared(
            "every rank's gradient shards: its slices of the mean gradient, zero-padded",
            [res["shards"] for res in ranks],
            expected,
            SUMMED,
        ),
        _line("collectives [op, payload bytes] of rank 0's backward", ranks[0]["calls"], calls),
        _line(f"ranks 1-{N - 1}: the same collectives", [res["calls"] == calls for res in ranks[1:]], [True] * (N - 1)),
        _verdict(
            not any(res["grads_after"] for res in ranks),
            "no parameter has a .grad after backward, on any rank",
            f"bytes of .grad still on the parameters after backward, per rank: {[res['grads_after'] for res in ranks]}"
            ": the bucket's full gradients outlive its reduce-scatter (only the shards may remain)",
        ),
        _line(
            "peak gradient bytes each rank holds (.grad alive + shards) = shards + largest bucket",
            [res["peak"] for res in ranks],
            [8 * (sum(S) + max(sizes))] * N,
        ),
    ]


# ---------------------------------------------------------------------------------------- part 3: ZeRO-3


def mlp_problem(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The full weights W_l: [out, in], the inputs x: [B, 10] and the targets: [B, 6] (the loss of a row is
    sum((y - target)^2); a rank's loss is the mean over its rows)."""
    gen = torch.Generator().manual_seed(seed)
    ws = [
        torch.randn(o, i, generator=gen, dtype=torch.float64) / i**0.5
        for i, o in zip(WIDTHS[:-1], WIDTHS[1:], strict=True)
    ]
    x = torch.randn(B, WIDTHS[0], generator=gen, dtype=torch.float64)
    target = torch.randn(B, WIDTHS[-1], generator=gen, dtype=torch.float64)
    return ws, x, target


def mlp(layer, shards: list[torch.Tensor], shapes: list[tuple[int, int]], x: torch.Tensor) -> list[torch.Tensor]:
    """The MLP with your layer: x [b, 10] -> [b, 13] -> [b, 13] -> [b, 6]; every activation it makes, in order."""
    acts = [x]
    for k, (w_shard, shape) in enumerate(zip(shards, shapes, strict=True)):
        acts.append(layer.apply(acts[-1], w_shard, shape))  # [b, out]
        if k < len(shards) - 1:
            acts.append(torch.tanh(acts[-1]))
    return acts


def _kept_for_backward(output: torch.Tensor, allowed: list[torch.Tensor]) -> int:
    """Bytes the custom layers in output's graph keep for backward (saved tensors and tensor attributes of ctx),
    besides the `allowed` tensors' storages (the activations and the shards)."""
    allowed_ptrs = {t.untyped_storage().data_ptr() for t in allowed}
    kept, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            kept += list(node.saved_tensors) + list(vars(node).values())
        stack += [nxt for nxt, _ in node.next_functions]
    mine = [t for t in _tensors(kept) if t.untyped_storage().data_ptr() not in allowed_ptrs]
    return tensor_bytes(mine)


def run_zero3(Zero3Linear) -> dict:
    """Rank code: forward and backward of the MLP with your layer, each weight held as this rank's shard only."""
    P, r = dist.get_world_size(), dist.get_rank()
    ws, x, target = mlp_problem()
    b = B // P
    x_r, t_r = x[r * b : (r + 1) * b], target[r * b : (r + 1) * b]  # this rank's rows: [b, 10], [b, 6]
    shards = [_shard(w, r, P).requires_grad_() for w in ws]  # [S_l]: all of W_l this rank ever keeps
    shapes = [tuple(w.shape) for w in ws]
    del ws
    with recording() as seen:
        acts = mlp(Zero3Linear, shards, shapes, x_r)
        forward_calls, seen.calls = seen.calls, []
        alive_after_forward = seen.gathered_alive()
        kept = _kept_for_backward(acts[-1], acts + shards)
        loss = ((acts[-1] - t_r) ** 2).sum(dim=-1).mean()
        loss.backward()
        alive_after_backward = seen.gathered_alive()
    return {
        "y": acts[-1].detach(),
        "grads": [s.grad for s in shards],
        "forward": forward_calls,
        "backward": seen.calls,
        "peak": seen.peak_gathered,
        "alive": [alive_after_forward, alive_after_backward],
        "kept": kept,
        "dtypes": sorted(seen.dtypes),
    }


def collect_zero3(Zero3Linear) -> dict:
    return {"ranks": list(parlab.launch(run_zero3, N, Zero3Linear, **LAUNCH))}


def judge_zero3(data) -> list[str]:
    ranks = data["ranks"]
    ws, x, target = mlp_problem()
    ws = [w.requires_grad_() for w in ws]
    h = x
    for k, w in enumerate(ws):
        h = h @ w.T
        h = torch.tanh(h) if k < len(ws) - 1 else h
    ((h - target) ** 2).sum(dim=-1).mean().backward()  # the mean over all B rows
    S = [-(-w.numel() // N) for w in ws]
    b = B // N
    gathers = [["all_gather", s * 8] for s in S]  # forward: layers 0, 1, 2
    backward = {"all_gather": [s * 8 for s in reversed(S)], "reduce_scatter": [N * s * 8 for s in reversed(S)]}
    same = [res["forward"] == gathers and _by_op(res["backward"]) == backward for res in ranks[1:]]
    return [
        _dtype_line(ranks),
        compare(
            "every rank's y (its rows)",
            [res["y"] for res in ranks],
            [h[r * b : (r + 1) * b] for r in range(N)],
        ).line,
        _weight_grads_line(ranks, [[_shard(w.grad, r, N) for w in ws] for r in range(N)]),
        _line("collectives [op, payload bytes] of rank 0's forward", ranks[0]["forward"], gathers),
        _line("payload bytes of rank 0's backward, by collective, in order", _by_op(ranks[0]["backward"]), backward),
        _line(f"ranks 1-{N - 1}: the same collectives", same, [True] * (N - 1)),
        _line(
            "peak bytes of gathered weights alive on each rank (the largest layer)",
            [res["peak"] for res in ranks],
            [N * max(S) * 8] * N,
        ),
        _line(
            "bytes of gathered weights alive after forward, after backward",
            [res["alive"] for res in ranks],
            [[0, 0]] * N,
        ),
        _line(
            "bytes the layers keep for backward besides activations and shards (a saved W, or a view of it, keeps "
            "its whole gathered buffer alive)",
            [res["kept"] for res in ranks],
            [0] * N,
        ),
    ]


def _weight_grads_line(ranks: list[dict], expected: list[list[torch.Tensor]]) -> str:
    """compare()'s line for the gradient shards; when each layer's is a multiple of one device's, which multiple
    (N: summed, not averaged; 1, 1/N, 1/N^2 from the last layer down: dL/dx averaged too)."""
    what = "every rank's gradient shards of W_0, W_1, W_2: its slices of dL/dW, zero-padded"
    got = [res["grads"] for res in ranks]
    line = compare(what, got, expected).line
    layers = len(expected[0])
    try:
        scales = [_scale([g[k] for g in got], [e[k] for e in expected]) for k in range(layers)]
    except (TypeError, IndexError):  # a missing gradient (None) or too few: compare's line says so
        return line
    if line.endswith(": PASS") or None in scales:
        return line
    said = ", ".join(f"W_{k} x {_fraction(c)}" for k, c in enumerate(scales))
    if all(_is(c, N) for c in scales):
        return f"{what}: {said} of one device's: {SUMMED}: FAIL"
    if all(_is(c, N ** -(layers - 1 - k)) for k, c in enumerate(scales)):
        return (
            f"{what}: {said} of one device's: dL/dx was divided by N too, and the error compounds layer by layer "
            "down the network; grad_y is the gradient of this rank's own loss: only dL/dW is averaged: FAIL"
        )
    return f"{what}: {said} of one device's: FAIL"
