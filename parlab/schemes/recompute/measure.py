"""Activation recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): keep fewer activations after the forward, recompute the rest in the backward.

The reference GPT (parlab/core/models.py) takes `GPTConfig(recompute=...)`:

    none       autograd keeps every tensor the backward needs
    selective  the attention core softmax(q k^T / sqrt(hs) + mask) v is checkpointed: q, k, v are kept, the
               [B, nh, T, T] scores and softmax are recomputed in the backward (they grow as T^2 and cost little)
    full       each block is checkpointed: only its input x [B, T, H] is kept, the whole block runs again

both through torch.utils.checkpoint (use_reentrant=False). Numerics are unchanged: the backward sees the very
same values. This file holds the memory formulas, term by term, and measures the model against them.

The memory formulas, term by term, are in parlab/schemes/recompute/theory.py (torch-free: the planner uses them).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from parlab.core.memory import saved_activations
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches

# ------------------------------------------------------------------------------------------------- measuring


def config_with(cfg: GPTConfig, mode: str) -> GPTConfig:
    return dataclasses.replace(cfg, recompute=mode)


def measure_layer(cfg: GPTConfig, batch: int, mode: str, seed: int = 0, device=None) -> int:
    """Bytes autograd keeps for one block's forward (parlab.core.memory.saved_activations), input x [B, T, H].
    device: where it runs (default the host)."""
    model = build_model(config_with(cfg, mode), seed, device=device)
    block = model.blocks[0]
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, cfg.seq_len, cfg.hidden)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(device, cfg.torch_dtype)  # host: seeded, moved
    x.requires_grad_()
    with saved_activations(exclude=block) as saved:
        block(x)
    return saved.bytes


def measure_model(cfg: GPTConfig, batch: int, mode: str, seed: int = 0, device=None) -> dict:
    """One training step of the whole GPT in `mode`: saved activation bytes (forward), matmul FLOPs of the
    forward and of the backward (torch.utils.flop_counter: the backward includes what is recomputed), the
    loss and the gradients (to compare modes). device: where it runs (default the host)."""
    model = build_model(config_with(cfg, mode), seed, device=device)
    x, y = make_batches(cfg, batch, 1, seed, device=device)[0]
    with FlopCounterMode(display=False) as fwd_flops, saved_activations(exclude=model) as saved:
        loss = lm_loss(model(x), y)
    with FlopCounterMode(display=False) as bwd_flops:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {
        "saved": saved.bytes,
        "forward_flops": fwd_flops.get_total_flops(),
        "backward_flops": bwd_flops.get_total_flops(),
        "loss": loss.detach(),
        "grads": grads,
    }


def recompute_flops_theory(cfg: GPTConfig, batch: int, mode: str) -> int:
    """Matmul FLOPs recomputed per layer in the backward (2 m n k per matmul).

    torch stops recomputing as soon as every kept tensor is back (early_stop, its default), and an op saves its
    inputs before it runs: so the last matmul of a checkpointed region is never rerun. selective reruns q k^T
    (2 b s^2 h) but not softmax x V; full reruns the block's forward but not the MLP's fc2:
    8 s b h^2 (q, k, v, proj) + 2 s b h F (fc) + 4 b s^2 h (q k^T, softmax x V).
    """
    s, b, h, F = cfg.seq_len, batch, cfg.hidden, cfg.ffn
    return {
        "none": 0,
        "selective": 2 * b * s * s * h,
        "full": 8 * s * b * h * h + 2 * s * b * h * F + 4 * b * s * s * h,
    }[mode]


def forward_flops_theory(cfg: GPTConfig, batch: int) -> int:
    """Matmul FLOPs of one block's forward: 8 s b h^2 + 4 s b h F + 4 b s^2 h (Megatron's 24 s b h^2 + 4 b s^2 h
    at F = 4h)."""
    s, b, h, F = cfg.seq_len, batch, cfg.hidden, cfg.ffn
    return 8 * s * b * h * h + 4 * s * b * h * F + 4 * b * s * s * h


def time_step(cfg: GPTConfig, batch: int, mode: str, repeats: int = 5, seed: int = 0, device=None) -> float:
    """Median seconds of one forward + backward of the whole GPT in `mode` (wall clock, this machine; device:
    where it runs, default the host)."""
    model = build_model(config_with(cfg, mode), seed, device=device)
    x, y = make_batches(cfg, batch, 1, seed, device=device)[0]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        lm_loss(model(x), y).backward()
        if x.is_cuda:  # GPU work is asynchronous: the step is over when the device is done
            torch.cuda.synchronize(x.device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
