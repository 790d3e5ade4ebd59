"""Lab 05's setup, shared by its checks' modules: the lab model's configurations, the batches, the number of ranks,
the buckets of part 2, and the two optimizers the lab hands out (Adam on a flat shard is the library's
`adam_step`; LAMB on one whole tensor is here, for part 4)."""

from __future__ import annotations

import torch
import torch.nn as nn

from parlab.core.lab_model import LabConfig, LabModel, lab_batches
from parlab.grading.labs.guard import library_line

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
N = 3  # ranks: the lab model's Psi = 22,688 is not a multiple of 3, nor is any bucket's or matrix's size
K = 3 * 8  # bytes of optimizer state per parameter in part 1, float64: master weight, Adam m, Adam v
LR = 1e-3  # Adam's and LAMB's learning rate

# Parts 1, 2 and 4: the lab model as parlab.core.lab_model builds it by default (2 blocks, GQA with 4 query heads
# and 2 key/value heads, untied head, float64): Psi = 22,688.
CFG = LabConfig()
B, STEPS = 6, 2  # global batch rows (b = B/N = 2 per rank), training steps of part 4

# Part 1: 6 steps under dynamic loss scaling (torch's GradScaler: the loss is multiplied by the scale; a step whose
# gradient holds an inf or a NaN is skipped and halves the scale; GROWTH steps taken in a row double it). Planted in
# each rank's scaled gradient: {step: (the rank, the element of its flat gradient [Psi], the value)}: an inf in step
# 3, a NaN in step 5 (fp16 overflows), and in step 6 a finite value so large that its square overflows float64 while
# the unscaled whole-batch gradient's does not (the float64 analogue of an fp16 gradient whose norm overflows fp16).
# Each element lies in another rank's shard, so that the rank that planted it is not the one whose shard holds it.
STEPS1 = 6
BATCHES1 = lab_batches(CFG, B, STEPS1, seed=0)  # [(x, y)], x, y: [B, T] token ids
OVERFLOW = {3: (1, 5, float("inf")), 5: (2, 7_570, float("nan")), 6: (0, 15_200, 1e156)}
MAX_NORM = 1.0  # the gradient's norm is clipped to this (the lab model's is about 1 in the plain steps)
SCALE0, GROWTH = 2.0**16, 2  # the first loss scale (GradScaler's init_scale); steps taken in a row before it doubles
BATCHES = BATCHES1[:STEPS]  # part 4's

# Part 2: gradient accumulation over M micro-batches of equal size, under a budget of full-gradient bytes. Each rank
# has b2 = 6 rows; the check runs one step for each (M, budget): the best choice differs from one budget to the next.
B2 = 18
BATCH2 = lab_batches(CFG, B2, 1, seed=1)[0]
CONFIGS = [(3, 112_000), (2, 130_000), (6, 76_000)]  # (M micro-batches, bytes of full gradients a rank may hold)

# Part 3: a small lab model with a TIED head (the LM head multiplies by the embedding matrix), one block.
CFG3 = LabConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, ffn=20, layers=1, tied=True)
B3 = 6
BATCH3 = lab_batches(CFG3, B3, 1, seed=2)[0]


def buckets_of(model: LabModel) -> list[list[nn.Parameter]]:
    """Part 2's buckets, in the model's order: the embedding; per block its attention (attn_norm, q, k, v, o) and
    its MLP (mlp_norm, gate, up, down); the final norm with the LM head."""
    buckets = [[model.embed.weight]]
    for block in model.blocks:
        buckets.append([*block.attn_norm.parameters(), *block.attn.parameters()])
        buckets.append([*block.mlp_norm.parameters(), *block.mlp.parameters()])
    buckets.append([model.norm.weight, *([] if model.head is None else [model.head.weight])])
    return buckets


def lamb_step(param, grad, m, v, step: int, lr: float = LR, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
    """LAMB (You et al. 2019) without weight decay, in place, on ONE WHOLE tensor: Adam's direction u, scaled by the
    tensor's trust ratio ||param|| / ||u||, so that every tensor moves by about lr of its own norm.

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  u = m_hat / (sqrt(v_hat) + eps);  p <- p - lr ||p||/||u|| u
    The two norms are over the whole tensor: the update of any element depends on all of them."""
    b1, b2 = betas
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    u = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    p_norm, u_norm = param.norm(), u.norm()
    ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else torch.ones((), dtype=param.dtype, device=param.device)
    param.sub_(lr * ratio * u)


# What no part may call: parlab's ZeRO code (parlab/grading/labs/guard.py), the handed-out Adam aside.
LIBRARY = ("schemes/zero/", "lessons/zero.py", "runs/zero.py", "schemes/hybrid/stage.py")
HANDED_OUT = ("schemes/zero/stages.py: adam_step",)  # the lab hands Adam out: calling it is allowed


def library_verdict(what: str, called: list[str]) -> str:
    """The guard's verdict: no call into parlab's ZeRO (the handed-out Adam aside; a function's inner
    comprehensions are not named beside it)."""
    named = [c for c in called if c not in HANDED_OUT and "<" not in c]
    return library_line(what, named or [c for c in called if c not in HANDED_OUT], "parlab's ZeRO code")
