"""The bug hunt's setup, shared by its checks' modules: the sizes of every part, seeded data, the lab models of the
parts (parlab.core.lab_model, small configurations), the grouped-query q, k, v of part 6, Adam (part 4's handed-out
optimizer step) and the small helpers the judges share."""

from __future__ import annotations

import math

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
PIPELINE_LAUNCH = {"timeout": 10, "echo": False}  # the pipeline part: a hang fails well within a cell's 20 s
P = 4  # ranks, in every part
IGNORE = -100  # the target of a token the loss leaves out (torch's cross_entropy ignore_index)

# Part 1, data parallel: the lab model, a global batch of B_DP documents padded to T, M micro-batches per rank.
DP_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, ffn=24, layers=2)
B_DP, M = 16, 2
# The real targets of each document of the batch (the rest of its T targets are IGNORE).
DP_LENGTHS = (8, 3, 5, 8, 2, 8, 6, 1, 7, 7, 4, 2, 8, 5, 3, 6)
# Part 2, tensor parallel: the MLP sublayer of the lab model's block 0 (RMSNorm, SwiGLU, residual), x: [BATCH, T_TP, H].
TP_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=8, heads=2, kv_heads=1, ffn=16, layers=1)
BATCH, T_TP = 2, 3
# Part 3, the zigzag layout: ZZ_B sequences of each length in ZIGZAG_T (2P chunks of T / 2P tokens).
ZIGZAG_T = (16, 24)
ZZ_B = 2
ZZ_CFG = LabConfig(vocab_size=32, seq_len=24, hidden=8, heads=2, kv_heads=1, ffn=16, layers=1)  # the loss shown
# Part 4, ZeRO with clipping: a lab model whose matrices hold PSI_M = 642 numbers (not a multiple of 4: the last shard
# is padded) and whose RMSNorm gains 18; Adam with ZERO_LR for ZERO_STEPS steps, the gradient clipped at MAX_NORM.
ZERO_CFG = LabConfig(vocab_size=29, seq_len=8, hidden=6, heads=3, kv_heads=1, ffn=11, layers=1)
B_ZERO, ZERO_STEPS, ZERO_LR, MAX_NORM = 8, 3, 0.05, 0.05
# The prediction: a Llama-3-8B-sized lab model (untied head) on PREDICT_N ranks, and the norms of a gradient.
PREDICT_CFG = {"vocab": 128256, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "layers": 32}
PREDICT_N = 96
PREDICT_NORMS = {"matrices": 3.0, "gains": 0.25}  # the norms of the averaged gradient's two parts
# Part 5, pipeline: the lab model with one block per stage; PIPE_B sequences per micro-batch; for each m in PIPE_MS,
# PIPE_STEPS[m] steps of m micro-batches (the loader holds one step more than that); the m of one launch together.
PIPE_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, ffn=24, layers=P)
PIPE_B = 2
PIPE_LAUNCHES = ((4, 3), (2,))
PIPE_MS = tuple(m for ms in PIPE_LAUNCHES for m in ms)
PIPE_STEPS = {4: 1, 3: 2, 2: 2}  # steps of each m: from the second one on, a loader that ran ahead shows
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


def first_wrong(what: str, got, expected: dict[str, torch.Tensor], names: str = "tensor") -> str:
    """One verdict on tensors by name: compare(...).line when it passes; a FAIL names the first wrong tensor and its
    worst element, with the expected and the received value."""
    verdict = compare(what, got, expected)
    if verdict.passed:
        return verdict.line
    if not isinstance(got, dict):
        return f"{what}: expected a dict of tensors by {names}, received {type(got).__name__}: FAIL"
    for name, want in expected.items():
        have = got.get(name)
        if not isinstance(have, torch.Tensor) or have.shape != want.shape:
            came = "nothing" if have is None else f"shape {list(getattr(have, 'shape', []))}"
            return f"{what}: {name}: expected shape {list(want.shape)}, received {came}: FAIL"
        diff = (have.to(torch.float64) - want).abs()
        if not diff.max().item() <= verdict.tol:
            i = int(torch.nan_to_num(diff, nan=math.inf).flatten().argmax())
            index = (
                [int(j) for j in torch.unravel_index(torch.tensor(i), want.shape)] if want.dim() else []
            )  # host: an index
            where = f"element {index}" if index else "value"
            return (
                f"{what}: {name}, {where}: expected {want.flatten()[i].item():.6g}, "
                f"received {have.flatten()[i].item():.6g}: FAIL"
            )
    return verdict.line


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
