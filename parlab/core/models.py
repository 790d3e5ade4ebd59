"""The reference model: a small GPT, its synthetic corpus, and a single-device training run.

Every parallel scheme in parlab splits this same model (by batch, by weight columns and rows, by layers, by
sequence, by optimizer state) and checks itself against `train_single_device` on the same data.

Shapes use B = batch, T = sequence length, H = hidden size, nh = heads, hs = H // nh, F = FFN size, V = vocab.

The model is deterministic from a seed (its own generator; the global RNG is untouched), has no dropout, and
runs in float64 (where exactness is the lesson) or float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from parlab.core.memory import tensor_bytes
from parlab.core.moe import MoE, MoEConfig, aux_loss

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes of one number of `dtype` ("float64" or torch.float64: 8)."""
    return (DTYPES[dtype] if isinstance(dtype, str) else dtype).itemsize


# Activation recomputation: none; selective (the attention core); full (each block). parlab/schemes/recompute/.
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 16  # the longest sequence (the position-embedding table's size)
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    ffn: int = 0  # 0 means 4 x hidden
    tied: bool = False  # share the token-embedding matrix with the LM head
    moe: MoEConfig | None = None  # Mixture-of-Experts FFNs (parlab/core/moe.py) in every moe.every-th block
    dtype: str = "float64"
    recompute: str = (
        "none"  # none; selective: the attention core; full: each block (parlab/schemes/recompute/measure.py)
    )

    def __post_init__(self):
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one number of the model's dtype (8 for float64)."""
        return dtype_bytes(self.dtype)

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads


# ------------------------------------------------------------------------------------------------------- model


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs) + causal mask) v, written out. q, k, v: [B, nh, T, hs] -> [B, nh, T, hs]."""
    T, hs = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # [B, nh, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # position t may not see t' > t
    scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v  # [B, nh, T, hs]


def recomputed(fn, *args: torch.Tensor) -> torch.Tensor:
    """fn(*args) whose activations are dropped after the forward and recomputed in the backward: autograd keeps
    only `args` (torch.utils.checkpoint). The model has no randomness, so no RNG state is stashed."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.recompute_core = cfg.recompute == "selective"
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H]
        B, T, H = x.shape
        nh = self.heads

        def split_heads(t):  # [B, T, H] -> [B, nh, T, hs]
            return t.view(B, T, nh, H // nh).transpose(1, 2)

        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        if self.recompute_core:  # selective: keep q, k, v; the [B, nh, T, T] scores are recomputed in the backward
            y = recomputed(causal_attention, q, k, v)
        else:
            y = causal_attention(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, H)  # heads side by side again: [B, T, H]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)  # H -> F
        self.proj = nn.Linear(cfg.ffn, cfg.hidden)  # F -> H

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        moe = cfg.moe is not None and cfg.moe.is_moe_layer(layer)
        self.mlp = MoE(cfg.hidden, cfg.ffn, cfg.moe) if moe else MLP(cfg)  # E expert MLPs and a router, or one MLP
        self.recompute_all = cfg.recompute == "full"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_all:  # full: keep only the block's input x; rerun the whole block in the backward
            return recomputed(self.layer, x)
        return self.layer(x)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)  # token embedding [V, H]
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)  # position embedding [T, H]
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)  # [V, H]
        if cfg.tied:
            self.lm_head.weight = self.wte.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embedding. idx: [B, T] token ids -> [B, T, H]."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and LM head. [B, T, H] -> logits [B, T, V]."""
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits: [B, T, V], targets: [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: GPTConfig, seed: int = 0, device: torch.device | str | None = None) -> GPT:
    """The GPT with deterministic weights: N(0, 0.02) matrices, zero biases, unit LayerNorm gains.

    Uses its own generator, so the result depends on `seed` and `cfg` only (not on the global RNG).
    device: where the model lives (rank code passes parlab.device(): its GPU under NCCL). The weights are drawn on
    the host with the CPU generator and then moved, so every device gets the same numbers.
    """
    model = GPT(cfg).to(cfg.torch_dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.02)  # host: the seeded draw
    return model if device is None else model.to(device)


# ------------------------------------------------------------------------------------------------------ data


@functools.lru_cache(maxsize=8)  # callers slice it and never write to it
def synthetic_corpus(vocab_size: int = 64, length: int = 4096, seed: int = 0) -> torch.Tensor:
    """A token stream with learnable structure: each token is followed by one of 3 likely successors.

    Generated here (no download): a random sparse bigram table, then a walk through it. [length] int64.
    """
    # The whole corpus is drawn on the host with the seeded CPU generator; make_batches moves the batches.
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab_size, (vocab_size, 3), generator=gen)  # host: each token's 3 likely next tokens
    tokens = torch.empty(length, dtype=torch.long)  # host: the walk below, on the host
    tokens[0] = 0
    choices = torch.randint(3, (length,), generator=gen)  # host: the seeded draw
    noise = torch.rand(length, generator=gen) < 0.1  # host: 10% of the time, any token
    random_tokens = torch.randint(vocab_size, (length,), generator=gen)  # host: the seeded draw
    for i in range(1, length):
        nxt = successors[tokens[i - 1], choices[i]]
        tokens[i] = random_tokens[i] if noise[i] else nxt
    return tokens


def make_batches(
    cfg: GPTConfig, batch_size: int, steps: int, seed: int = 0, device: torch.device | str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches (x, y) of the synthetic corpus: x, y: [batch_size, seq_len], y = x shifted by one.

    device: where the batches go (rank code passes parlab.device()); they are drawn on the host, then moved."""
    corpus = synthetic_corpus(cfg.vocab_size, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        starts = torch.randint(len(corpus) - cfg.seq_len - 1, (batch_size,), generator=gen)  # host: seeded draw
        x = torch.stack([corpus[s : s + cfg.seq_len] for s in starts])
        y = torch.stack([corpus[s + 1 : s + cfg.seq_len + 1] for s in starts])
        batches.append((x, y) if device is None else (x.to(device), y.to(device)))
    return batches


# ---------------------------------------------------------------------------------------- single-device training


def make_optimizer(params, kind: str = "sgd", lr: float = 0.1) -> torch.optim.Optimizer:
    """The optimizer every scheme uses: plain SGD by default (a wrong gradient shows up directly in the
    parameters), or Adam (whose two states per parameter are what ZeRO partitions)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {kind!r}")


@dataclass
class TrainResult:
    losses: list[float]  # loss of each step, before that step's update
    grads: dict[str, torch.Tensor]  # gradients of the first step, by parameter name
    params: dict[str, torch.Tensor]  # parameters after the last step, by parameter name


def train_single_device(
    cfg: GPTConfig,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    seed: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.1,
) -> TrainResult:
    """The reference: train the GPT on one device for len(batches) steps of the full global batch."""

    def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(model(x), y) + aux_loss(model)  # + the MoE load-balancing loss (0 without MoE)

    device = batches[0][0].device if batches else None  # the reference trains where its batches are (the host)
    return train_model(build_model(cfg, seed, device=device), batches, loss_of, optimizer, lr)


def train_model(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn, optimizer: str = "sgd", lr: float = 0.1
) -> TrainResult:
    """Train `model` on one device, one step per global batch (x, y), the loss being loss_fn(model, x, y).
    Returns the loss of each step, the gradients of step 1 and the parameters after the last step, by name."""
    opt = make_optimizer(model.parameters(), optimizer, lr)
    losses, first_grads = [], {}
    for step, (x, y) in enumerate(batches):
        loss = loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return TrainResult(losses, first_grads, params)


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters a model (or a rank's shard of one) actually holds (counted by parlab.core.memory)."""
    return tensor_bytes(model.parameters())
