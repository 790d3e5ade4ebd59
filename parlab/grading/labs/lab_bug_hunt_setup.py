"""The bug hunt's setup, shared by its checks' modules: the sizes of every part, seeded data, the MLP, and the
q, k, v of parts 3 and 6."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
PIPELINE_LAUNCH = {"timeout": 10, "echo": False}  # the deadlock part: a hang fails well within a cell's 20 s
P = 4  # ranks, in every part

# Part 1, data parallel: an MLP IN -> HID -> OUT; the global batch of B rows, M micro-batches per rank.
IN, HID, OUT, B_DP, M = 8, 16, 4, 16, 2
# Part 2, tensor parallel: Megatron's MLP, x: [BATCH, T_TP, H], fc: H -> FFN, proj: FFN -> H.
BATCH, T_TP, H, FFN = 2, 3, 8, 16
# Part 3, zigzag ring attention: q, k, v: [1, HEADS, T, HS] for each T in ZIGZAG_T.
HEADS, HS, ZIGZAG_T = 2, 4, (16, 19)
# Part 4, ZeRO: an MLP of PSI = 103 parameters (ZERO_SIZES), Adam with ZERO_LR for ZERO_STEPS steps.
ZERO_SIZES, B_ZERO, ZERO_STEPS, ZERO_LR = (6, 10, 3), 8, 3, 0.05
P_PREDICT = 7  # the prediction: the same model on 7 ranks
# Part 5, pipeline: P stages of Linear(PIPE_H, PIPE_H) + tanh; PIPE_M micro-batches of PIPE_B rows.
PIPE_H, PIPE_B, PIPE_M = 8, 2, 6
# Part 6, ring attention's forward: each rank holds RING_C tokens of q, k, v: [1, HEADS, RING_C, HS].
RING_C = 3


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def mlp(sizes: tuple[int, ...], seed: int) -> nn.Sequential:
    """Linear, tanh, Linear, ... in float64, the same weights on every rank for the same seed."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layer = nn.Linear(n_in, n_out, dtype=torch.float64)
        with torch.no_grad():
            layer.weight.copy_(_randn(n_out, n_in, seed=seed + 2 * i) / math.sqrt(n_in))
            layer.bias.copy_(_randn(n_out, seed=seed + 2 * i + 1) / 4)
        layers += [layer, nn.Tanh()]
    return nn.Sequential(*layers[:-1])


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
    """q, k, v and the output gradient G, each [1, HEADS, T, HS]: the whole sequence."""
    return tuple(_randn(1, HEADS, T, HS, seed=seed + i) for i in range(4))
