"""Lab 05's setup, shared by its checks' modules: the models, the batches, the number of ranks, and the GPT's
layers as buckets (ZeRO-2's buckets in part 2, parlab.schemes.zero.stages's units in the prediction)."""

from __future__ import annotations

import torch.nn as nn

from parlab.core.models import GPTConfig, make_batches

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
CFG = GPTConfig()  # the reference GPT: 2 layers, hidden 32, float64: Psi = 30,080 parameters
B, STEPS, LR = 6, 2, 1e-3  # global batch rows, training steps, Adam's learning rate
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T] token ids
N = 3  # ranks in parts 1-3: 30,080 is not a multiple of 3, nor is any layer's parameter count
K = 3 * 8  # bytes of optimizer state per parameter in float64: master weight, Adam m, Adam v

# Part 3: an MLP x [B, 10] -> 13 -> 13 -> 6, tanh between the layers, float64. W_l: [out, in], no bias.
WIDTHS = (10, 13, 13, 6)


def buckets_of(model: nn.Module) -> list[list[nn.Parameter]]:
    """One bucket per layer, in the model's order: wte, wpe, each block, ln_f, lm_head."""
    layers = [model.wte, model.wpe, *model.blocks, model.ln_f, model.lm_head]
    return [list(layer.parameters()) for layer in layers]
