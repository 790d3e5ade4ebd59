"""Lab 05, part 3 (the check zero3): ZeRO-3 layers for a lab model whose LM head is tied to its embedding.

parlab's ZeRO-3 gathers a layer's parameters in module hooks; the lab model's LM head reads its weight (here the
embedding matrix) outside any module call, so those hooks never gather it for the head. The student writes the
gathering as two autograd Functions, a matrix product and a lookup; `lab_forward` runs the tied lab model with
them, every matrix held as a rank's [S] shard only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core.lab_model import apply_rope, build_lab_model, gqa_attention, lab_loss, rms_norm
from parlab.core.probe import _tensors
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab05_recording import (
    _by_op,
    _dtype_line,
    _fraction,
    _is,
    _line,
    _scale,
    _shard,
    one_thread,
    recording,
    same_line,
    tensors_line,
)
from parlab.grading.labs.lab05_setup import B3, BATCH3, CFG3, LAUNCH, N


def lab_forward(Linear, Embedding, shards: dict, shapes: dict, idx: torch.Tensor, uses: list) -> torch.Tensor:
    """The tied lab model (CFG3) with your layers: every matrix is used through them, as its [S] shard; the RMSNorm
    gains stay at one (not trained in this part). idx: [b, T] token ids -> logits [b, T, V]. `uses` collects every
    input your layers were given (the check allows a layer to keep those for backward)."""
    cfg, (b, T), hd = CFG3, idx.shape, CFG3.head_size
    positions = torch.arange(T, device=idx.device)  # every row is a sequence of its own: positions 0..T-1
    gain = torch.ones(cfg.hidden, dtype=torch.float64, device=idx.device)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:  # x @ W^T, W = the matrix `name`: [out, in]
        uses.append(x)
        return Linear.apply(x, shards[name], shapes[name])

    def heads(t: torch.Tensor) -> torch.Tensor:  # [b, T, n*hd] -> [b, n, T, hd]
        return t.view(b, T, -1, hd).transpose(1, 2)

    uses.append(idx)
    x = Embedding.apply(idx, shards["embed.weight"], shapes["embed.weight"])  # [b, T, H]: rows of the embedding
    for i in range(cfg.layers):
        a = rms_norm(x, gain, cfg.eps)
        q = apply_rope(heads(linear(a, f"blocks.{i}.attn.q.weight")), positions, cfg.rope_base)  # [b, nq, T, hd]
        k = apply_rope(heads(linear(a, f"blocks.{i}.attn.k.weight")), positions, cfg.rope_base)  # [b, nkv, T, hd]
        v = heads(linear(a, f"blocks.{i}.attn.v.weight"))  # [b, nkv, T, hd]
        y = gqa_attention(q, k, v).transpose(1, 2).reshape(b, T, -1)  # [b, T, nq*hd]
        x = x + linear(y, f"blocks.{i}.attn.o.weight")
        a = rms_norm(x, gain, cfg.eps)
        gated = F.silu(linear(a, f"blocks.{i}.mlp.gate.weight")) * linear(a, f"blocks.{i}.mlp.up.weight")  # [b, T, F]
        x = x + linear(gated, f"blocks.{i}.mlp.down.weight")
    return linear(rms_norm(x, gain, cfg.eps), "embed.weight")  # the tied LM head: [b, T, V]


def matrices() -> dict[str, torch.Tensor]:
    """The tied lab model's matrices (seed 0), by name: the embedding (also the LM head) and each block's seven."""
    return {n: p.detach() for n, p in build_lab_model(CFG3, seed=0).named_parameters() if p.dim() == 2}


def _kept_for_backward(output: torch.Tensor, allowed: list[torch.Tensor]) -> int:
    """Bytes the custom layers in output's graph keep for backward (saved tensors and tensor attributes of ctx),
    besides the `allowed` tensors' storages (the layers' inputs and the shards)."""
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
    mine = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(kept)}
    return sum(nbytes for ptr, nbytes in mine.items() if ptr not in allowed_ptrs)


def run_zero3(Zero3Linear, Zero3Embedding, library: tuple) -> dict:
    """Rank code: forward and backward of the tied lab model with your layers, each matrix held as this rank's shard
    only; the loss is the mean over this rank's rows."""
    P, r = dist.get_world_size(), dist.get_rank()
    full = matrices()
    shards = {n: _shard(w, r, P).to(parlab.device()).requires_grad_() for n, w in full.items()}  # [S] each
    shapes = {n: tuple(w.shape) for n, w in full.items()}
    del full
    b = B3 // P
    x, y = (t[r * b : (r + 1) * b].to(parlab.device()) for t in BATCH3)  # this rank's rows: [b, T]
    uses = []
    with recording() as seen, library_calls(library) as called:
        logits = lab_forward(Zero3Linear, Zero3Embedding, shards, shapes, x, uses)
        forward_calls, seen.calls = seen.calls, []
        alive_after_forward = seen.gathered_alive()
        kept = _kept_for_backward(logits, uses + list(shards.values()))
        lab_loss(logits, y).backward()
        alive_after_backward = seen.gathered_alive()
    return {
        "logits": logits.detach(),
        "grads": {n: s.grad for n, s in shards.items()},
        "forward": forward_calls,
        "backward": seen.calls,
        "peak": seen.peak_gathered,
        "alive": [alive_after_forward, alive_after_backward],
        "kept": kept,
        "dtypes": sorted(seen.dtypes),
        "library": list(called),
    }


def collect_zero3(Zero3Linear, Zero3Embedding) -> dict:
    from parlab.grading.labs.lab05_zero import LIBRARY

    return {"ranks": list(parlab.launch(run_zero3, N, Zero3Linear, Zero3Embedding, LIBRARY, **LAUNCH))}


class _Logged(torch.autograd.Function):
    """The judge's own layer, on one device: y = x W^T with the whole W, logging the collectives ZeRO-3 makes."""

    @staticmethod
    def forward(ctx, x, w, name, log):
        log.append(("all_gather", name, "forward"))
        ctx.save_for_backward(x, w)
        ctx.name, ctx.log = name, log
        return x @ w.T

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        ctx.log += [("all_gather", ctx.name, "backward"), ("reduce_scatter", ctx.name, "backward")]
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return grad_y @ w, grad_w, None, None


class _LoggedLookup(torch.autograd.Function):
    """The judge's own lookup: rows of W, and in backward only a reduce-scatter (a lookup's gradient needs no W)."""

    @staticmethod
    def forward(ctx, idx, w, name, log):
        log.append(("all_gather", name, "forward"))
        ctx.save_for_backward(idx)
        ctx.name, ctx.log, ctx.rows = name, log, w.shape[0]
        return w[idx]

    @staticmethod
    def backward(ctx, grad_y):
        (idx,) = ctx.saved_tensors
        ctx.log.append(("reduce_scatter", ctx.name, "backward"))
        grad_w = torch.zeros(ctx.rows, grad_y.shape[-1], dtype=grad_y.dtype)  # host: the reference on one device
        grad_w.index_add_(0, idx.reshape(-1), grad_y.reshape(-1, grad_y.shape[-1]))
        return None, grad_w, None, None


def reference_step() -> tuple[torch.Tensor, dict[str, torch.Tensor], list]:
    """One device, the whole batch: the logits, every matrix's gradient (the mean loss over all B3 rows), and the
    collectives ZeRO-3 would make, in order: (op, matrix, phase)."""
    full = {n: w.clone().requires_grad_() for n, w in matrices().items()}
    shapes = {n: tuple(w.shape) for n, w in full.items()}
    log = []

    class Linear:
        @staticmethod
        def apply(x, w, shape):
            return _Logged.apply(x, w, names[id(w)], log)

    class Lookup:
        @staticmethod
        def apply(idx, w, shape):
            return _LoggedLookup.apply(idx, w, names[id(w)], log)

    names = {id(w): n for n, w in full.items()}
    logits = lab_forward(Linear, Lookup, full, shapes, BATCH3[0], [])
    lab_loss(logits, BATCH3[1]).backward()
    return logits.detach(), {n: w.grad for n, w in full.items()}, log


def judge_zero3(data) -> list[str]:
    from parlab.grading.labs.lab05_zero import library_verdict

    ranks = data["ranks"]
    with one_thread():
        logits, grads, log = reference_step()
    S = {n: -(-g.numel() // N) for n, g in grads.items()}
    b = B3 // N
    forward = [[op, 8 * S[name]] for op, name, phase in log if phase == "forward"]
    backward = _by_op(
        [[op, (N if op == "reduce_scatter" else 1) * 8 * S[name]] for op, name, phase in log if phase == "backward"]
    )
    largest = N * max(S.values()) * 8
    return [
        library_verdict("zero3", [c for res in ranks for c in res["library"]]),
        _dtype_line(ranks),
        tensors_line(
            "every rank's logits (its rows)",
            [{"logits": res["logits"]} for res in ranks],
            [{"logits": logits[r * b : (r + 1) * b]} for r in range(N)],
        ),
        _weight_grads_line(ranks, [{n: _shard(g, r, N) for n, g in grads.items()} for r in range(N)]),
        _line("collectives [op, payload bytes] of rank 0's forward", ranks[0]["forward"], forward),
        _backward_line(_by_op(ranks[0]["backward"]), backward, 8 * S["embed.weight"]),
        same_line(
            [{"forward": res["forward"], "backward": _by_op(res["backward"])} for res in ranks[1:]],
            {"forward": forward, "backward": backward},
        ),
        _line(
            "peak bytes of gathered weights alive on each rank (the largest matrix)",
            [res["peak"] for res in ranks],
            [largest] * N,
        ),
        _line(
            "bytes of gathered weights alive after forward, after backward",
            [res["alive"] for res in ranks],
            [[0, 0]] * N,
        ),
        _line(
            "bytes the layers keep for backward besides their inputs and the shards (a saved W, or a view of it, keeps "
            "its whole gathered buffer alive)",
            [res["kept"] for res in ranks],
            [0] * N,
        ),
    ]


def _backward_line(measured: dict, theory: dict, embed_gather: int) -> str:
    """The backward's payloads by collective; when the only difference is one more all-gather of the embedding at
    the end, the lookup's backward gathered a matrix it does not need."""
    what = "payload bytes of rank 0's backward, by collective, in order"
    line = _line(what, measured, theory)
    gathers = measured.get("all_gather", [])
    if not line.endswith(": FAIL") or gathers[:-1] != theory.get("all_gather") or gathers[-1:] != [embed_gather]:
        return line
    if {k: v for k, v in measured.items() if k != "all_gather"} != {
        k: v for k, v in theory.items() if k != "all_gather"
    }:
        return line
    return (
        f"{what}: one all-gather of the embedding too many, at the end: the lookup's backward gathered W, but the "
        "gradient of a lookup needs only which rows were read: FAIL"
    )


def _weight_grads_line(ranks: list[dict], expected: list[dict]) -> str:
    """tensors_line for the gradient shards; when each matrix's is the same multiple of one device's, say which
    (N: summed over ranks, not averaged)."""
    what = "every rank's gradient shards of each matrix (the tied one from both its uses): its slices of dL/dW"
    got = [res["grads"] for res in ranks]
    line = tensors_line(what, got, expected)
    if line.endswith(": PASS"):
        return line
    try:
        scales = [_scale([g[n] for g in got], [e[n] for e in expected]) for n in expected[0]]
    except (TypeError, KeyError):  # a missing gradient (None): tensors_line's FAIL says so
        return line
    if all(_is(c, N) for c in scales):
        return f"{what}: every matrix's is N = {N} times one device's: the ranks' gradients were summed: FAIL"
    if None not in scales and len({_fraction(c) for c in scales}) > 1:
        said = ", ".join(
            f"{n.removeprefix('blocks.0.')} x {_fraction(c)}" for n, c in zip(expected[0], scales, strict=True)
        )
        return f"{what}: {said} of one device's: FAIL"
    return line
