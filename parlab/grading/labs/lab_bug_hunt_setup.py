"""The bug hunt's setup, shared by its checks' modules: the sizes of every part, seeded data, the lab models of
parts 1, 2, 4 and 5 (parlab.core.lab_model, small configurations), the grouped-query q, k, v of parts 3 and 6, and
Adam (the handed-out optimizer step of part 4)."""

from __future__ import annotations

import torch
import torch.nn as nn

import parlab
from parlab.core.lab_model import LabConfig

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
PIPELINE_LAUNCH = {"timeout": 10, "echo": False}  # the deadlock part: a hang fails well within a cell's 20 s
P = 4  # ranks, in every part

# Part 1, data parallel: the lab model, a global batch of B_DP sequences, M micro-batches per rank.
DP_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, ffn=24, layers=2)
B_DP, M = 16, 2
# Part 2, tensor parallel: the MLP sublayer of the lab model's block 0 (RMSNorm, SwiGLU, residual), x: [BATCH, T_TP, H].
TP_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=8, heads=2, kv_heads=1, ffn=16, layers=1)
BATCH, T_TP = 2, 3
# Parts 3 and 6, attention with grouped K/V heads: q [1, HEADS, T, HD], k and v [1, KV_HEADS, T, HD].
HEADS, KV_HEADS, HD = 4, 2, 4
ZIGZAG_T = (16, 19)  # part 3: the sequence lengths (19 is not a multiple of 2P)
RING_C = 3  # part 6: each rank holds RING_C tokens
# Part 4, ZeRO: a lab model of PSI = 678 parameters (678 = 4 x 169 + 2), Adam with ZERO_LR for ZERO_STEPS steps.
ZERO_CFG = LabConfig(vocab_size=29, seq_len=8, hidden=6, heads=3, kv_heads=1, ffn=12, layers=1)
B_ZERO, ZERO_STEPS, ZERO_LR = 8, 3, 0.05
P_PREDICT = 7  # the prediction: the same model on 7 ranks
# Part 5, pipeline: the lab model with one block per stage; PIPE_M micro-batches of PIPE_B sequences.
PIPE_CFG = LabConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, ffn=24, layers=P)
PIPE_B, PIPE_M = 2, 6


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


def attention_problem(T: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q [1, HEADS, T, HD], k and v [1, KV_HEADS, T, HD] (query head h reads K/V head h // (HEADS / KV_HEADS)), and
    the output gradient G [1, HEADS, T, HD]: the whole sequence."""
    q = _randn(1, HEADS, T, HD, seed=seed)
    k, v = (_randn(1, KV_HEADS, T, HD, seed=seed + i) for i in (1, 2))
    return q, k, v, _randn(1, HEADS, T, HD, seed=seed + 3)


def adam_step(param, grad, m, v, step: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
    """torch.optim.Adam's update (no weight decay), in place, on flat tensors [S] (a rank's shard): part 4's
    optimizer, handed out (the same arithmetic as torch's Adam and as parlab.schemes.zero.stages.adam_step).

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  p <- p - lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps)
    """
    b1, b2 = betas
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (v.sqrt() / (1 - b2**step) ** 0.5).add_(eps)
    param.addcdiv_(m, denom, value=-lr / (1 - b1**step))
