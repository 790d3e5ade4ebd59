"""Lab 05, part 3 (the check zero3): ZeRO-3 with prefetching, for a lab model whose LM head is tied to its
embedding.

parlab's ZeRO-3 gathers a layer's parameters in module hooks; the lab model's LM head reads its weight (here the
embedding matrix) outside any module call, so those hooks never gather it for the head. The student writes the
gathering as two autograd Functions, a matrix product and a lookup, and an object of their own that the Functions
share (`Prefetcher`): each matrix's all-gather is to be in flight while the use before it computes. `lab_forward`
runs the tied lab model with them, every matrix held as a rank's [S] shard only, and notes when each use's Function
ran (forward and backward), so that the check can tell from parlab.core.comm's trace when each all-gather was
issued and waited for.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core import comm
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
from parlab.grading.labs.lab05_setup import B3, BATCH3, CFG3, LAUNCH, LIBRARY, N, library_verdict


def uses_of(cfg=CFG3) -> list[str]:
    """The matrix of each use, in the order lab_forward makes them: the lookup of the embedding (use 0), each block's
    q, k, v, o, gate, up, down, and the tied LM head (the embedding again, the last use)."""
    block = ["attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"]
    return ["embed.weight", *(f"blocks.{i}.{m}.weight" for i in range(cfg.layers) for m in block), "embed.weight"]


def lab_forward(Linear, Embedding, pre, shards: dict, idx: torch.Tensor, inputs: list, ran=None) -> torch.Tensor:
    """The tied lab model (CFG3) with your layers: use i of a matrix (uses_of()) is `Linear.apply(x, w_shard, pre,
    i)`, or `Embedding.apply(idx, w_shard, pre, 0)` for the lookup; pre: your Prefetcher, the same object for every
    use. The RMSNorm gains stay at one (not trained in this part). idx: [b, T] token ids -> logits [b, T, V].
    `inputs` collects every input your layers were given (a layer may keep those for backward); `ran` (the check's)
    collects when each use's Function ran: [phase, use, start, end]."""
    cfg, (b, T), hd = CFG3, idx.shape, CFG3.head_size
    positions = torch.arange(T, device=idx.device)  # every row is a sequence of its own: positions 0..T-1
    gain = torch.ones(cfg.hidden, dtype=torch.float64, device=idx.device)
    use = iter(range(len(uses_of(cfg))))

    def timed(function, first, name: str) -> torch.Tensor:  # function.apply(first, W's shard, pre, i), timed
        i = next(use)
        inputs.append(first)
        start = time.perf_counter()
        y = function.apply(first, shards[name], pre, i)
        if ran is not None:
            ran.append(["forward", i, start, time.perf_counter()])
            if isinstance(y, torch.Tensor) and y.grad_fn is not None:  # the same for this use's backward
                began = []
                y.grad_fn.register_prehook(lambda grads, began=began: began.append(time.perf_counter()) and None)
                y.grad_fn.register_hook(
                    lambda grads_in, grads_out, i=i, began=began: (
                        ran.append(["backward", i, began[-1] if began else -1.0, time.perf_counter()]) and None
                    )
                )
        return y

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:  # x @ W^T, W = the matrix `name`: [out, in]
        return timed(Linear, x, name)

    def heads(t: torch.Tensor) -> torch.Tensor:  # [b, T, n*hd] -> [b, n, T, hd]
        return t.view(b, T, -1, hd).transpose(1, 2)

    x = timed(Embedding, idx, "embed.weight")  # [b, T, H]: rows of the embedding
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
    model = build_lab_model(CFG3, seed=0)  # host: the reference's matrices; rank code moves what it takes
    return {n: p.detach() for n, p in model.named_parameters() if p.dim() == 2}


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


def run_zero3(Prefetcher, Zero3Linear, Zero3Embedding, library: tuple) -> dict:
    """Rank code: forward and backward of the tied lab model with your layers, each matrix held as this rank's shard
    only; the loss is the mean over this rank's rows."""
    P, r = dist.get_world_size(), dist.get_rank()
    full = matrices()
    shards = {n: _shard(w, r, P).to(parlab.device()).requires_grad_() for n, w in full.items()}  # [S] each
    shapes = {n: tuple(w.shape) for n, w in full.items()}
    del full
    b = B3 // P
    x, y = (t[r * b : (r + 1) * b].to(parlab.device()) for t in BATCH3)  # this rank's rows: [b, T]
    inputs, ran, since = [], [], time.perf_counter()
    with recording() as seen, library_calls(library) as called:
        pre = Prefetcher(shards, shapes, uses_of())
        logits = lab_forward(Zero3Linear, Zero3Embedding, pre, shards, x, inputs, ran)
        forward_calls, seen.calls = seen.calls, []
        forward_alive, seen.alive_at_gather = seen.alive_at_gather, []
        alive_after_forward = seen.gathered_alive()
        kept = _kept_for_backward(logits, inputs + list(shards.values()))
        lab_loss(logits, y).backward()
        alive_after_backward = seen.gathered_alive()
    gathers = [[e.start, -1.0 if e.end is None else e.end] for e in comm.trace_events() if e.kind == "all_gather"]
    return {
        "logits": logits.detach(),
        "grads": {n: s.grad for n, s in shards.items()},
        "forward": forward_calls,
        "backward": seen.calls,
        "alive_at_gather": [forward_alive, seen.alive_at_gather],  # gathered bytes alive as each all-gather returned
        "alive": [alive_after_forward, alive_after_backward],
        "gathers": [g for g in gathers if g[0] >= since],  # [issued, waited for] of each traced all-gather
        "ran": ran,
        "kept": kept,
        "dtypes": sorted(seen.dtypes),
        "library": list(called),
    }


def collect_zero3(Prefetcher, Zero3Linear, Zero3Embedding) -> dict:

    ranks = parlab.launch(run_zero3, N, Prefetcher, Zero3Linear, Zero3Embedding, LIBRARY, **LAUNCH)
    return {"ranks": list(ranks)}


class _Logged(torch.autograd.Function):
    """The judge's own layer, on one device: y = x W^T with the whole W, logging the collectives ZeRO-3 makes."""

    @staticmethod
    def forward(ctx, x, w, use, log):
        log.append(("all_gather", use, "forward"))
        ctx.save_for_backward(x, w)
        ctx.use, ctx.log = use, log
        return x @ w.T

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        ctx.log += [("all_gather", ctx.use, "backward"), ("reduce_scatter", ctx.use, "backward")]
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return grad_y @ w, grad_w, None, None


class _LoggedLookup(torch.autograd.Function):
    """The judge's own lookup: rows of W, and in backward only a reduce-scatter (its gradient is W's rows that were
    read: no W needed)."""

    @staticmethod
    def forward(ctx, idx, w, use, log):
        log.append(("all_gather", use, "forward"))
        ctx.save_for_backward(idx)
        ctx.use, ctx.log, ctx.rows = use, log, w.shape[0]
        return w[idx]

    @staticmethod
    def backward(ctx, grad_y):
        (idx,) = ctx.saved_tensors
        ctx.log.append(("reduce_scatter", ctx.use, "backward"))
        grad_w = torch.zeros(ctx.rows, grad_y.shape[-1], dtype=grad_y.dtype)  # host: the reference on one device
        grad_w.index_add_(0, idx.reshape(-1), grad_y.reshape(-1, grad_y.shape[-1]))
        return None, grad_w, None, None


def reference_step() -> tuple[torch.Tensor, dict[str, torch.Tensor], list]:
    """One device, the whole batch: the logits, every matrix's gradient (the mean loss over all B3 rows), and the
    collectives ZeRO-3 makes, in order: (op, use, phase)."""
    full = {n: w.clone().requires_grad_() for n, w in matrices().items()}
    log = []

    class Linear:
        @staticmethod
        def apply(x, w, pre, use):
            return _Logged.apply(x, w, use, log)

    class Lookup:
        @staticmethod
        def apply(idx, w, pre, use):
            return _LoggedLookup.apply(idx, w, use, log)

    logits = lab_forward(Linear, Lookup, None, full, BATCH3[0], [])
    lab_loss(logits, BATCH3[1]).backward()
    return logits.detach(), {n: w.grad for n, w in full.items()}, log


def judge_zero3(data) -> list[str]:

    ranks = data["ranks"]
    with one_thread():
        logits, grads, log = reference_step()
    uses = uses_of()
    S = {n: -(-g.numel() // N) for n, g in grads.items()}
    gathered = [8 * N * S[name] for name in uses]  # bytes of each use's gathered matrix [N S]
    b = B3 // N
    forward = [[op, 8 * S[uses[i]]] for op, i, phase in log if phase == "forward"]
    backward = _by_op(
        [[op, (N if op == "reduce_scatter" else 1) * 8 * S[uses[i]]] for op, i, phase in log if phase == "backward"]
    )
    # which use each all-gather serves, in order, in each phase
    order = {phase: [i for op, i, p in log if op == "all_gather" and p == phase] for phase in ("forward", "backward")}
    # the gathered bytes alive as each all-gather returns: its use's matrix and the previous one's (computing)
    alive = {
        phase: [gathered[i] + (gathered[seq[k - 1]] if k else 0) for k, i in enumerate(seq)]
        for phase, seq in order.items()
    }
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
        _line("payload bytes of rank 0's backward, by collective, in order", _by_op(ranks[0]["backward"]), backward),
        same_line(
            [{"forward": res["forward"], "backward": _by_op(res["backward"])} for res in ranks[1:]],
            {"forward": forward, "backward": backward},
        ),
        _in_flight_line(ranks, order, uses),
        _alive_line(ranks, [alive["forward"], alive["backward"]]),
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


def _in_flight_line(ranks: list[dict], order: dict[str, list[int]], uses: list[str]) -> str:
    """Each all-gather but the first of a phase issued while the use before it in that phase ran (its Function's
    call) and waited for while its own use ran; the first of each phase waited for while its use ran."""
    what = (
        "each all-gather issued while the previous use's Function ran and waited for in its own use's (the first of "
        "forward and of backward: waited for in its own)"
    )
    for r, res in enumerate(ranks):
        ran = {(phase, i): (start, end) for phase, i, start, end in res["ran"]}
        gathers = iter(res["gathers"])
        for phase in ("forward", "backward"):
            executed = [i for p, i, _, _ in res["ran"] if p == phase]  # uses in the order their Functions ran
            for k, i in enumerate(order[phase]):
                issued, waited = next(gathers, (None, None))
                name = f"rank {r}, {phase}, the all-gather of use {i} ({uses[i]})"
                if issued is None:
                    return f"{what}: {name}: expected in parlab.core.comm's trace, received nothing: FAIL"
                own = ran.get((phase, i), (0.0, -1.0))
                place = executed.index(i) if i in executed else 0
                before = executed[place - 1] if k and place else None
                window = ran.get((phase, before)) if before is not None else None
                when = _when(issued, ran, phase, uses)
                if window is not None and not window[0] <= issued <= window[1]:
                    return (
                        f"{what}: {name}: expected issued during use {before} ({uses[before]}), received issued "
                        f"{when}: FAIL"
                    )
                if not own[0] <= waited <= own[1]:
                    said = "never waited for" if waited < 0 else f"waited for {_when(waited, ran, phase, uses)}"
                    return f"{what}: {name}: expected waited for during use {i} itself, received {said}: FAIL"
    return f"{what}, on every rank: PASS"


def _when(t: float, ran: dict, phase: str, uses: list[str]) -> str:
    """When time t fell, in the uses' Function calls: 'during use i (name)', 'between ...', 'before ...'."""
    inside = [i for (p, i), (start, end) in ran.items() if start <= t <= end]
    if inside:
        p, i = next((p, i) for (p, i), (start, end) in ran.items() if start <= t <= end)
        return f"during use {i} ({uses[i]}){'' if p == phase else f' in {p}'}"
    ended = [(end, p, i) for (p, i), (start, end) in ran.items() if end < t]
    if not ended:
        return "before the first use"
    _, p, i = max(ended)
    return f"after use {i}'s Function returned ({uses[i]}, {p}), before the next one ran"


def _alive_line(ranks: list[dict], expected: list[list[int]]) -> str:
    """The bytes of gathered weights alive as each all-gather returned, per phase, against the theory: the matrix of
    the use just gathered, plus the one of the use computing meanwhile."""
    what = "bytes of gathered weights alive as each all-gather returned (forward, backward)"
    for r, res in enumerate(ranks):
        for phase, got, want in zip(("forward", "backward"), res["alive_at_gather"], expected, strict=True):
            if got != want:
                k = next(
                    (k for k, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want))
                )
                have = got[k] if k < len(got) else "no all-gather"
                need = want[k] if k < len(want) else "no all-gather"
                return f"{what}: rank {r}, {phase}, all-gather {k}: expected {need}, received {have}: FAIL"
    return f"{what}: {expected} on every rank: PASS"


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
