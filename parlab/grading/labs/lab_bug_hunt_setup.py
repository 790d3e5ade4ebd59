"""The bug hunt's setup, shared by its checks' modules: the sizes of every part, seeded data, the lab models of the
parts (parlab.core.lab_model, small configurations), the grouped-query q, k, v of part 6, Adam (part 4's handed-out
optimizer step) and the small helpers the judges share."""

from __future__ import annotations

import torch
import torch.nn as nn

import parlab
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig
from parlab.grading.labs.guard import library_line

# What no answer may call (parlab/grading/labs/guard.py): the library's implementations of the six schemes the bugs
# are about, and the lesson helpers that hold the same code. The handed-out pieces live in this lab's own modules.
LIBRARY = (
    "schemes/data_parallel.py",
    "schemes/tensor_parallel.py",
    "schemes/sequence/",
    "schemes/zero/",
    "schemes/pipeline/",
    "lessons/data_parallel.py",
    "lessons/tensor_parallel.py",
    "lessons/sequence_parallel.py",
    "lessons/zero.py",
    "lessons/pipeline.py",
)

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
# A hang the diagnosis names stops within seconds; one it cannot name stops at the timeout: 30 s leaves a loaded
# machine room to finish a correct run, and the part's two launches fit a cell's 120 s.
PIPELINE_LAUNCH = {"timeout": 30, "echo": False}
P = 4  # ranks, in every part
IGNORE = -100  # the target of a token the loss leaves out (torch's cross_entropy ignore_index)
PAD = 0  # the input id a padded position holds (part 1)

# Part 1, data parallel: the lab model trained DP_STEPS SGD steps, each on a global batch of B_DP documents padded to
# T (document i of each batch has DP_LENGTHS[i] real targets, the rows dealt out in another order each step), M
# micro-batches per rank.
DP_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, ffn=24, layers=2)
B_DP, M, DP_STEPS, DP_LR = 16, 2, 3, 0.5
DP_LENGTHS = (8, 3, 5, 8, 2, 8, 6, 1, 7, 7, 4, 2, 8, 5, 3, 6)
# Part 2, tensor parallel: the lab model's block (nq = P query heads, nkv = 2 K/V heads, SwiGLU width F) on P ranks,
# TP_STEPS SGD steps on the mean squared error of its output, x: [BATCH, T_TP, H].
TP_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=8, heads=4, kv_heads=2, ffn=16, layers=1)
BATCH, T_TP, TP_STEPS, TP_LR = 2, 4, 3, 0.5
# Part 3, the zigzag layout of packed documents: ZZ_B sequences of each length in ZIGZAG_T, cut into 2P chunks by
# torch.tensor_split, each packing documents of the lengths ZZ_DOCS[T][i] (sequence i) end to end; each rank sends
# each neighbour at most ZZ_SENT numbers per sequence.
ZIGZAG_T = (16, 20, 24, 23)
ZZ_B, ZZ_SENT = 2, 2
ZZ_DOCS = {
    16: ((1, 3, 3, 3, 3, 3), (2, 3, 3, 2, 3, 3)),
    20: ((4, 4, 4, 4, 4), (5, 4, 4, 3, 4)),
    24: ((2, 14, 8), (4, 11, 9)),
    23: ((1, 20, 2), (5, 16, 2)),
}
ZZ_CFG = LabConfig(vocab_size=32, seq_len=24, hidden=8, heads=2, kv_heads=1, ffn=16, layers=1)  # the loss shown
# Part 4, hybrid sharding with clipping: the lab model's matrices (PSI_M = 642 numbers) sharded over groups of
# `shard` ranks, replicated over the P / shard groups (rank r in shard group r // shard), for each shard-group size
# in ZERO_LAYOUTS, in this order (4: one group of all 4, the user's earlier run, its last shard padded; 2: two groups
# of 2, the user's nodes); its RMSNorm gains (18 numbers) replicated on every rank; Adam with ZERO_LR for ZERO_STEPS
# steps, the gradient clipped at MAX_NORM.
ZERO_CFG = LabConfig(vocab_size=29, seq_len=8, hidden=6, heads=3, kv_heads=1, ffn=11, layers=1)
ZERO_LAYOUTS = (4, 2)
B_ZERO, ZERO_STEPS, ZERO_LR, MAX_NORM = 8, 3, 0.05, 0.05
# The prediction: a Llama-3-8B-sized lab model (untied head) on PREDICT_N ranks, tensor parallel over PREDICT_TP of
# them (Megatron's slices, the vocabulary split too; more ranks than K/V heads, so each K/V head is held whole by
# PREDICT_TP / kv_heads ranks; the RMSNorm gains whole everywhere), and across the tensor-parallel groups hybrid
# sharding of each rank's slice in shard groups of PREDICT_SHARD; the norms of the three parts of an averaged gradient:
# the matrices Megatron slices (q, o, gate, up, down, the embedding and the head), the K/V matrices, the gains.
PREDICT_CFG = {"vocab": 128256, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "layers": 32}
PREDICT_N, PREDICT_TP, PREDICT_SHARD = 640, 16, 10
PREDICT_NORMS = {"sliced": 3.0, "kv": 1.0, "gains": 0.25}
# Part 5, pipeline: the lab model with a tied LM head, one block per stage; PIPE_B sequences per micro-batch; for each
# m, PIPE_STEPS SGD steps of m micro-batches (the loader holds one step more than that); the m of one launch together.
PIPE_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, ffn=24, layers=P, tied=True)
PIPE_B, PIPE_STEPS, PIPE_LR = 2, 2, 0.5
PIPE_LAUNCHES = ((4, 3), (2, 1))
PIPE_MS = tuple(m for ms in PIPE_LAUNCHES for m in ms)
# Part 6, ring attention: q [1, nq, P c, HD], k and v [1, nkv, P c, HD], for each (nq, nkv) in RING_HEADS.
RING_HEADS = ((4, 4), (6, 2))
HD, RING_C = 4, 3


def _randn(*shape, seed: int) -> torch.Tensor:
    """A seeded draw on the host, moved to this rank's device (parlab.device(): the CPU on gloo)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(parlab.device())  # host: the seeded draw


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }


def _no_error(what: str, fn, *args):
    """(the value of fn(*args), []) or (None, [a FAIL line]) when it raises: a judge never crashes on odd data."""
    try:
        return fn(*args), []
    except Exception as exc:  # noqa: BLE001  (whatever the data, a verdict line)
        return None, [f"{what}: {type(exc).__name__}: {str(exc)[:120]}: FAIL"]


def library_verdict(part: str, called: list[str]) -> str:
    """The verdict on the calls into LIBRARY the ranks saw while running `part` (their lists, joined)."""
    return library_line(part, called, "the library's implementation of the scheme")


# The process-group methods (parlab.core.probe's "op") of each collective, whichever torch.distributed call made it.
REDUCE_SCATTER = ("reduce_scatter_single", "reduce_scatter", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base")
ALL_GATHER = ("all_gather_single", "allgather", "allgather_into_tensor_coalesced", "_allgather_base")
ALL_REDUCE = ("allreduce", "allreduce_coalesced")


def summed(ops: tuple[str, ...]):
    """The bytes of one step's calls of these process-group methods: step {op: bytes} -> int."""
    return lambda step: sum(step.get(op, 0) for op in ops)


def bytes_line(what: str, received: list, least: int, most: int) -> str:
    """One verdict over the ranks: each rank's bytes (or each of its steps' bytes, a list) in [least, most]; a FAIL
    names the first rank (and step) that is not."""
    bound = f"{least}" if least == most else f"from {least} to {most}"
    for r, got in enumerate(received):
        for step, value in enumerate(got if isinstance(got, list) else [got]):
            if not least <= value <= most:
                where = f"rank {r}, step {step + 1}" if isinstance(got, list) else f"rank {r}"
                return f"{what}: {where}: expected {bound}, received {value}: FAIL"
    return f"{what}: {bound} on every rank: PASS"


def digits_apart(a: float, b: float) -> tuple[str, str]:
    """Two numbers printed with as many decimals as it takes to tell them apart (6 at least)."""
    for d in range(6, 17):
        x, y = f"{a:.{d}f}", f"{b:.{d}f}"
        if x != y:
            return x, y
    return f"{a!r}", f"{b!r}"


def curve_line(what: str, got, expected: list[float], step: str = "step") -> str:
    """One verdict on a curve, a number per step (the loss, the norm a run logs): compare's line when every step
    matches one device's; else the first step that does not, with what one device had there and what came."""
    try:
        values = [float(v) for v in got]
    except (TypeError, ValueError):
        return f"{what}: expected {len(expected)} numbers, received {type(got).__name__}: FAIL"
    if len(values) != len(expected):
        return f"{what}: expected {len(expected)} numbers, received {len(values)}: FAIL"
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731  host: the judge's numbers
    verdict = compare(what, as_tensor(values), as_tensor(expected))
    if verdict.passed:
        return verdict.line
    k = next(i for i, (a, b) in enumerate(zip(values, expected, strict=True)) if not abs(a - b) <= verdict.tol)
    want, came = digits_apart(expected[k], values[k])
    return f"{what}: {step} {k + 1}: expected {want} (one device), received {came}: FAIL"


def every_rank(what: str, got: list, expected) -> str:
    """One verdict on what every rank holds (parameters, outputs) against one device's: compare's line, the largest
    error over every rank and tensor, naming none of them (the symptom, not its place)."""
    return compare(what, got, [expected] * len(got)).line


def attention_problem(heads: int, kv_heads: int, T: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q [1, heads, T, HD], k and v [1, kv_heads, T, HD] (query head h reads K/V head h // (heads / kv_heads)), and
    the output gradient G [1, heads, T, HD]: the whole sequence."""
    q = _randn(1, heads, T, HD, seed=seed)
    k, v = (_randn(1, kv_heads, T, HD, seed=seed + i) for i in (1, 2))
    return q, k, v, _randn(1, heads, T, HD, seed=seed + 3)


def adam_step(param, grad, m, v, step: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
    """torch.optim.Adam's update (no weight decay), in place, on flat tensors (a rank's shard, or a whole tensor):
    part 4's optimizer, handed out (the same arithmetic as torch's Adam).

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  p <- p - lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps)
    """
    b1, b2 = betas
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (v.sqrt() / (1 - b2**step) ** 0.5).add_(eps)
    param.addcdiv_(m, denom, value=-lr / (1 - b1**step))


def clip_coefficient(total_norm, max_norm: float = MAX_NORM):
    """What torch.nn.utils.clip_grad_norm_ multiplies every gradient by: min(1, max_norm / (norm + 1e-6)).
    total_norm: a number or a 0-d tensor, the norm of the whole model's gradient."""
    coef = max_norm / (total_norm + 1e-6)
    return torch.clamp(coef, max=1.0) if isinstance(coef, torch.Tensor) else min(coef, 1.0)


def restart_positions(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions counted inside a stretch of tokens. starts: [B, n] bool, True where a token begins a document ->
    (pos, before), both [B, n] int64: pos counts 0, 1, 2, ... from the stretch's first token and from 0 again at
    each document start; before is 1 on the tokens ahead of the stretch's first document start, 0 from it on."""
    idx = torch.arange(starts.shape[1], device=starts.device).expand(starts.shape)  # [B, n]
    last = torch.where(starts, idx, 0).cummax(dim=1).values  # the latest start at or before each token (0: none)
    before = (starts.long().cummax(dim=1).values == 0).long()
    return idx - last, before
