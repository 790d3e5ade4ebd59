"""The labs' model: a small Llama-style transformer, on purpose not the lessons' GPT.

The lessons parallelise parlab's reference GPT (parlab/core/models.py): LayerNorm, a GeLU MLP with biases, one
key/value head per query head, a learned position table. Models trained in practice differ from that textbook one,
and so does this one, so that the library's parallel code does not fit it without real change:

- **RMSNorm** (Zhang & Sennrich 2019): x / rms(x) * g, a gain and no bias, no mean subtracted.
- **Grouped-query attention** (GQA, Ainslie et al. 2023): nq query heads share nkv < nq key/value heads; query head h
  reads key/value head h // (nq / nkv). K and V are [B, nkv, T, hd]: fewer heads than Q.
- **Rotary position embeddings** (RoPE, Su et al. 2021): a token's position enters as a rotation of its q and k, by
  angles that depend on the token's *global* position t (no position table). A rank that holds tokens t0..t1 of a
  sequence must rotate them with t0..t1, not with 0..t1-t0.
- **SwiGLU MLP** without biases (Shazeer 2020): down(silu(gate(x)) * up(x)); gate and up are [F, H], down [H, F].
- An **untied** LM head by default (`tied=True` shares the embedding matrix).

Shapes: B batch, T sequence, H hidden, nq query heads, nkv key/value heads, hd = H / nq the head size, F the SwiGLU
width, V vocabulary. Parameter names (`named_parameters()`), with their shapes:

    embed.weight [V, H]
    blocks.{i}.attn_norm.weight [H]
    blocks.{i}.attn.q.weight [nq*hd, H]     blocks.{i}.attn.o.weight [H, nq*hd]
    blocks.{i}.attn.k.weight [nkv*hd, H]    blocks.{i}.attn.v.weight [nkv*hd, H]
    blocks.{i}.mlp_norm.weight [H]
    blocks.{i}.mlp.gate.weight [F, H]       blocks.{i}.mlp.up.weight [F, H]          blocks.{i}.mlp.down.weight [H, F]
    norm.weight [H]
    head.weight [V, H]                      (absent when tied: the head uses embed.weight)

Deterministic from a seed (its own generator), no dropout, float64 by default. The lessons never print its
parallel forms: they are the labs' to write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlab.core.models import DTYPES, TrainResult, make_batches, train_model


@dataclass(frozen=True)
class LabConfig:
    vocab_size: int = 64
    seq_len: int = 16  # the longest sequence (RoPE needs no table; make_batches cuts sequences of this length)
    hidden: int = 32  # H
    heads: int = 4  # nq, query heads
    kv_heads: int = 2  # nkv, key/value heads; each serves heads / kv_heads query heads
    ffn: int = 64  # F, the SwiGLU width
    layers: int = 2
    tied: bool = False  # share the embedding matrix with the LM head
    rope_base: float = 10000.0
    eps: float = 1e-6  # RMSNorm's
    dtype: str = "float64"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"RoPE rotates pairs: the head size {self.head_size} must be even")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def head_size(self) -> int:
        """hd = H / nq."""
        return self.hidden // self.heads

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: nq / nkv."""
        return self.heads // self.kv_heads


# ----------------------------------------------------------------------------------------------- the pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension. x: [..., H], weight: [H]."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_angles(positions: torch.Tensor, head_size: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation of each position: [len(positions), hd/2] each. Pair i of a head (its
    dimensions i and i + hd/2) turns by the angle position * base^(-2i/hd)."""
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64, device=positions.device) / head_size)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate q or k by the positions of its tokens. x: [B, heads, T, hd]; positions: [T], the tokens' global
    positions in their sequence. The "rotate half" convention: dimensions i and i + hd/2 form pair i."""
    half = x.shape[-1] // 2
    cos, sin = rope_angles(positions, x.shape[-1], base)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # [T, hd/2], broadcast over B and heads
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + mask) v with grouped K/V heads. q: [B, nq, T, hd]; k, v: [B, nkv, T, hd] with
    nkv dividing nq: query head h attends with key/value head h // (nq / nkv). -> [B, nq, T, hd]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [B, nq, T, hd]: kv head j serves query heads j*group .. (j+1)*group-1
    v = v.repeat_interleave(group, dim=1)
    T, hd = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # [B, nq, T, T]
    if causal:
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v


# ----------------------------------------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))  # host: built with the module, moved with it (.to)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GQAttention(nn.Module):
    def __init__(self, cfg: LabConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_size
        self.q = nn.Linear(cfg.hidden, cfg.heads * hd, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.heads * hd, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x: [B, T, H]
        B, T, _ = x.shape
        hd = self.cfg.head_size

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, n*hd] -> [B, n, T, hd]
            return t.view(B, T, -1, hd).transpose(1, 2)

        q = apply_rope(heads(self.q(x)), positions, self.cfg.rope_base)  # [B, nq, T, hd]
        k = apply_rope(heads(self.k(x)), positions, self.cfg.rope_base)  # [B, nkv, T, hd]
        y = gqa_attention(q, k, heads(self.v(x)))  # [B, nq, T, hd]
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LabConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # H -> F
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # H -> F
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)  # F -> H

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LabBlock(nn.Module):
    """Pre-norm: x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x))."""

    def __init__(self, cfg: LabConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = GQAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class LabModel(nn.Module):
    def __init__(self, cfg: LabConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)  # [V, H]
        self.blocks = nn.ModuleList(LabBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.head = None if cfg.tied else nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)  # [V, H]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head. [B, T, H] -> [B, T, V]."""
        weight = self.embed.weight if self.head is None else self.head.weight
        return self.norm(x) @ weight.T

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """idx: [B, T] token ids -> logits [B, T, V]. positions: the tokens' positions (default 0..T-1)."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx)  # [B, T, H]
        for block in self.blocks:
            x = block(x, positions)
        return self.logits(x)


def lab_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits: [B, T, V], targets: [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_lab_model(cfg: LabConfig | None = None, seed: int = 0, device: torch.device | str | None = None) -> LabModel:
    """The lab model with deterministic weights: N(0, 0.02) matrices, unit RMSNorm gains. Its own generator: the
    result depends on `seed` and `cfg` only. device: where it lives (rank code: parlab.device()); drawn on the
    host, then moved."""
    cfg = cfg or LabConfig()
    model = LabModel(cfg).to(cfg.torch_dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # host: the seeded draw, then copied into the parameter wherever it lives
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.02)  # host: the seeded draw
    return model if device is None else model.to(device)


def lab_batches(
    cfg: LabConfig, batch_size: int, steps: int, seed: int = 0, device: torch.device | str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches (x, y) of parlab's synthetic corpus: x, y: [batch_size, seq_len] token ids (moved to
    `device` when given)."""
    return make_batches(cfg, batch_size, steps, seed, device=device)


def train_lab_single_device(
    cfg: LabConfig,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    seed: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.1,
) -> TrainResult:
    """The labs' reference: the lab model trained on one device for len(batches) steps of the whole global batch
    (losses of each step, gradients of step 1, parameters after the last step, by name)."""

    def loss_of(model: LabModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lab_loss(model(x), y)

    device = batches[0][0].device if batches else None  # the reference trains where its batches are (the host)
    return train_model(build_lab_model(cfg, seed, device=device), batches, loss_of, optimizer, lr)
