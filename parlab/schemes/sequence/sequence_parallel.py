"""Sequence parallelism: split the activations along the sequence, because long sequences break memory.

A transformer's activations grow as B x T x H per layer, and attention's scores as B x nh x T x T. Tensor
parallelism splits the weights but leaves every rank holding [B, T, H] in its LayerNorms and residual stream;
data parallelism cannot cut a single sequence. Three ways to split the sequence itself over P ranks:

  Megatron SP (Korthikanti et al. 2022), on top of tensor parallelism: the regions TP leaves replicated
      (LayerNorm, residual adds, dropout) hold only T/P tokens. Megatron's g (all-reduce) after each TP region
      becomes a reduce-scatter along the sequence, and f (identity) before it becomes an all-gather; their
      backward conjugates swap them. An all-gather + a reduce-scatter move what one all-reduce moves, so the
      activation memory of those regions falls by P at no extra communication.
  DeepSpeed-Ulysses (parlab/schemes/sequence/ulysses.py): weights replicated, every activation [B, T/P, H]; attention by
  two
      all-to-alls that trade the sequence split for a head split.
  Ring Attention (parlab/schemes/sequence/ring_attention.py): weights replicated, every activation [B, T/P, H];
  attention by
      passing K/V blocks round a ring; contiguous or zigzag layout of the sequence over the ranks.

With Ulysses and ring, each rank's weights see only its own tokens' gradient: the gradients are summed over the
sequence group after backward, like data parallelism's. Shapes: B batch, T sequence, H hidden, F FFN, V vocab,
nh heads, hs head size, P = ranks in the group. Rank r of a Megatron SP group holds tokens [r*T/P, (r+1)*T/P).

`python -m parlab run megatron-sp|ulysses|ring|ring-zigzag --world 4` runs and checks each against one device
(parlab/runs/sequence_parallel.py); lesson 04 (notebooks/04_sequence_parallel.ipynb) draws them.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlab.core import comm
from parlab.core.memory import tensor_bytes
from parlab.core.models import GPT, GPTConfig, build_model, causal_attention, recomputed
from parlab.schemes.sequence.ring_attention import kv_block_bytes, ring_attention, sequence_split
from parlab.schemes.sequence.ulysses import a2a_bytes_per_call, ulysses_attention
from parlab.schemes.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    train_tensor_parallel,
    vocab_parallel_cross_entropy,
)

METHODS = ("megatron-sp", "ulysses", "ring", "ring-zigzag")

# --------------------------------------------------------------------------- Megatron SP's conjugate operators


def _gather_seq(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """All-gather along the sequence (dim 1): [B, T/P, H] on each rank -> [B, T, H] on every rank."""
    P = comm.group_size(group)
    shard = x.transpose(0, 1).contiguous()  # the sequence first, so rank blocks stack along dim 0: [T/P, B, H]
    out = torch.empty((P * shard.shape[0], *shard.shape[1:]), dtype=x.dtype, device=x.device)  # [T, B, H]
    comm.all_gather_into_tensor(out, shard, group=group, label=label)
    return out.transpose(0, 1)  # [B, T, H]


def _reduce_scatter_seq(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """Reduce-scatter along the sequence: [B, T, H] partial sums -> rank r's tokens of the sum, [B, T/P, H]."""
    P = comm.group_size(group)
    full = x.transpose(0, 1).contiguous()  # [T, B, H]
    out = torch.empty((full.shape[0] // P, *full.shape[1:]), dtype=x.dtype, device=x.device)  # [T/P, B, H]
    comm.reduce_scatter_tensor(out, full, group=group, label=label)
    return out.transpose(0, 1)  # [B, T/P, H]


class GatherFromSequenceParallel(torch.autograd.Function):
    """Megatron SP's g: all-gather along the sequence forward, reduce-scatter backward (it replaces TP's f).

    Entering a TP region: each rank computes only its part of the region from the gathered [B, T, H], so its
    dL/dX is a partial sum over the ranks; the backward sums them and hands each rank its own tokens.
    """

    @staticmethod
    def forward(ctx, x, label, group):
        ctx.label, ctx.group = label, group
        return _gather_seq(x, group, f"sp-gather fwd {label}")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group, f"sp-gather bwd {ctx.label}"), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Megatron SP's g-bar: reduce-scatter along the sequence forward, all-gather backward (it replaces TP's g).

    Leaving a TP region: each rank holds a partial [B, T, H]; the forward sums them and keeps this rank's T/P
    tokens. The backward gathers dL/dY of every token, which each rank's part of the region needs.
    """

    @staticmethod
    def forward(ctx, x, label, group):
        ctx.label, ctx.group = label, group
        return _reduce_scatter_seq(x, group, f"sp-scatter fwd {label}")

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group, f"sp-scatter bwd {ctx.label}"), None, None


def gather_from_sequence_parallel(x, label: str = "", group=None):
    """[B, T/P, H] (this rank's tokens) -> [B, T, H]; the backward reduce-scatters."""
    return GatherFromSequenceParallel.apply(x, label, group)


def reduce_scatter_to_sequence_parallel(x, label: str = "", group=None):
    """[B, T, H] (this rank's partial sum) -> [B, T/P, H] (this rank's tokens of the sum); the backward all-gathers."""
    return ReduceScatterToSequenceParallel.apply(x, label, group)


def _sequence_split_grad(p: nn.Parameter) -> nn.Parameter:
    """Mark a replicated parameter used on this rank's T/P tokens only: its gradient is a partial sum over the
    ranks and must be all-reduced (Megatron's `sequence_parallel` attribute)."""
    p.sequence_parallel = True
    return p


class SequenceParallelRowLinear(RowParallelLinear):
    """Row-parallel linear whose forward ends with a reduce-scatter along the sequence instead of the all-reduce:
    x [B, T, in/P] -> [B, T/P, out]. The bias is added to this rank's tokens only (its gradient is partial)."""

    def __init__(self, full: nn.Linear, *, label: str = "", group=None):
        super().__init__(full, label=label, group=group)
        if self.bias is not None:
            _sequence_split_grad(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # X_r A_r: [B, T, out]
        y = reduce_scatter_to_sequence_parallel(partial, self.label, self.group)  # g-bar: [B, T/P, out]
        return y + self.bias if self.bias is not None else y


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """Vocabulary-parallel embedding whose output is reduce-scattered along the sequence: [B, T] -> [B, T/P, H]."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mine = (idx >= self.vocab_start) & (idx < self.vocab_end)  # [B, T]: the ids this rank owns
        local = torch.where(mine, idx - self.vocab_start, 0)
        e = F.embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)  # [B, T, H], partial
        return reduce_scatter_to_sequence_parallel(e, self.label, self.group)  # [B, T/P, H]: my tokens of the sum


def _sp_layernorm(full_ln: nn.LayerNorm) -> nn.LayerNorm:
    ln = copy.deepcopy(full_ln)
    for p in ln.parameters():
        p.tp_split_dim = None
        _sequence_split_grad(p)
    return ln


class MegatronSPBlock(nn.Module):
    """A transformer block with tensor parallelism inside attention and MLP and sequence parallelism outside.

    x: [B, T/P, H], this rank's tokens. ln1 -> g (all-gather: [B, T, H]) -> q, k, v column-parallel (my heads)
    -> attention -> proj row-parallel -> g-bar (reduce-scatter: [B, T/P, H]) -> residual; the same for the MLP.
    """

    def __init__(self, full, index: int, group=None):
        super().__init__()
        self.group, P = group, comm.group_size(group)
        self.index = index
        self.ln1, self.ln2 = _sp_layernorm(full.ln1), _sp_layernorm(full.ln2)
        self.attn = nn.Module()  # the same parameter names as parlab.core.models.Block
        a, label = full.attn, f"attn {index}"
        for name in ("q", "k", "v"):  # rank r owns heads [r*nh/P, (r+1)*nh/P); no f: g's backward sums dL/dx
            setattr(self.attn, name, ColumnParallelLinear(getattr(a, name), copy_input=False, label=label, group=group))
        self.attn.proj = SequenceParallelRowLinear(a.proj, label=label, group=group)
        self.mlp = nn.Module()
        m, label = full.mlp, f"mlp {index}"
        self.mlp.fc = ColumnParallelLinear(m.fc, copy_input=False, label=label, group=group)
        self.mlp.proj = SequenceParallelRowLinear(m.proj, label=label, group=group)
        if a.heads % P:
            raise ValueError(f"heads={a.heads} is not divisible by world_size={P}")
        self.heads, self.head_size = a.heads // P, a.q.out_features // a.heads  # nh/P, hs
        self.recompute_core, self.recompute_all = (
            a.recompute_core,
            full.recompute_all,
        )  # parlab/schemes/recompute/measure.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T/P, H]
        return recomputed(self.layer, x) if self.recompute_all else self.layer(x)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        h = gather_from_sequence_parallel(self.ln1(x), f"attn {self.index}", self.group)  # g: [B, T, H]
        B, T, _ = h.shape

        def split_heads(t):  # [B, T, H/P] -> [B, nh/P, T, hs]
            return t.view(B, T, self.heads, self.head_size).transpose(1, 2)

        a = self.attn
        q, k, v = split_heads(a.q(h)), split_heads(a.k(h)), split_heads(a.v(h))
        y = recomputed(causal_attention, q, k, v) if self.recompute_core else causal_attention(q, k, v)  # my heads
        x = x + a.proj(y.transpose(1, 2).reshape(B, T, -1))  # g-bar inside: [B, T/P, H]
        h = gather_from_sequence_parallel(self.ln2(x), f"mlp {self.index}", self.group)  # g: [B, T, H]
        return x + self.mlp.proj(F.gelu(self.mlp.fc(h)))  # [B, T, F/P] -> g-bar -> [B, T/P, H]


class MegatronSPGPT(nn.Module):
    """parlab.core.models.GPT with tensor parallelism and Megatron sequence parallelism over `group`, same names.

    Sharded as TensorParallelGPT (p.tp_split_dim); replicated parameters used on T/P tokens (LayerNorms, wpe,
    row-parallel biases) carry p.sequence_parallel: their gradients are all-reduced (`sync_grads`).
    forward(idx [B, T], the whole batch on every rank) -> logits [B, T, V/P]; loss(idx, targets) -> scalar.
    """

    def __init__(self, full: GPT, group=None):
        super().__init__()
        self.group, self.rank, self.world_size = group, comm.group_rank(group), comm.group_size(group)
        if self.world_size < 2:
            raise ValueError(megatron_needs_tp(self.world_size))
        self.cfg = full.cfg
        self.wte = SequenceParallelEmbedding(full.wte, group)
        self.wpe = copy.deepcopy(full.wpe)  # replicated, used on my positions only
        _sequence_split_grad(self.wpe.weight).tp_split_dim = None
        self.blocks = nn.ModuleList(MegatronSPBlock(b, i, group) for i, b in enumerate(full.blocks))
        self.ln_f = _sp_layernorm(full.ln_f)
        self.lm_head = ColumnParallelLinear(full.lm_head, copy_input=False, label="lm_head", group=group)
        if self.cfg.tied:
            self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if not hasattr(p, "tp_split_dim"):
                p.tp_split_dim = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        mine = torch.arange(T, device=idx.device).chunk(self.world_size)[self.rank]  # my positions [r*T/P, ...)
        x = self.wte(idx) + self.wpe(mine)  # [B, T/P, H]
        for block in self.blocks:
            x = block(x)  # 2 all-gathers and 2 reduce-scatters forward per block, and their conjugates backward
        h = gather_from_sequence_parallel(self.ln_f(x), "lm_head", self.group)  # [B, T, H]
        return self.lm_head(h)  # [B, T, V/P]: my vocabulary columns

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(idx), targets, self.wte.vocab_start, self.group)

    def sync_grads(self) -> None:
        """All-reduce the partial gradients of the parameters used on this rank's tokens only (one flat call)."""
        grads = [p.grad for p in self.parameters() if getattr(p, "sequence_parallel", False)]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=self.group, label="sp grads")
        for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(summed.view_as(g))


def megatron_needs_tp(world_size: int) -> str:
    return (
        f"Megatron sequence parallelism runs inside a tensor-parallel group, and world_size={world_size} gives no "
        "tensor parallelism: it splits the regions TP leaves replicated. Use world_size >= 2, or ulysses / ring "
        "for sequence parallelism without tensor parallelism."
    )


# ----------------------------------------------------------------- Ulysses and ring: weights replicated, T split


class SequenceShardedGPT(nn.Module):
    """parlab.core.models.GPT on this rank's tokens only, attention by Ulysses or ring attention over `group`.

    Every parameter is replicated (same names as the GPT). forward(idx, positions): idx [B, T/P] this rank's
    tokens, positions [T/P] their places in the sequence (zigzag: chunks r and 2P-1-r) -> logits [B, T/P, V].
    """

    def __init__(self, full: GPT, method: str = "ring", group=None):
        super().__init__()
        if method not in METHODS[1:]:
            raise ValueError(f"method must be one of {METHODS[1:]}, got {method!r}")
        self.method, self.group = method, group
        self.cfg = full.cfg
        for name in ("wte", "wpe", "blocks", "ln_f", "lm_head"):
            setattr(self, name, copy.deepcopy(getattr(full, name)))
        if self.cfg.tied:
            self.lm_head.weight = self.wte.weight

    @property
    def layout(self) -> str:
        return "zigzag" if self.method == "ring-zigzag" else "contiguous"

    def attention(self, q, k, v, index: int):
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, causal=True, group=self.group, label=f"attn {index}")
        return ring_attention(q, k, v, causal=True, group=self.group, layout=self.layout, label=f"attn {index}")

    def forward(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(positions)  # [B, T/P, H]
        B, Tp, H = x.shape
        nh = self.cfg.heads

        def split_heads(t):  # [B, T/P, H] -> [B, nh, T/P, hs]
            return t.view(B, Tp, nh, H // nh).transpose(1, 2)

        for i, block in enumerate(self.blocks):
            a, h = block.attn, block.ln1(x)

            y = self.attention(split_heads(a.q(h)), split_heads(a.k(h)), split_heads(a.v(h)), i)  # [B, nh, T/P, hs]
            x = x + a.proj(y.transpose(1, 2).reshape(B, Tp, H))
            x = x + block.mlp(block.ln2(x))  # per token: no communication
        return self.lm_head(self.ln_f(x))  # [B, T/P, V]

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
        """This rank's share of the mean loss: the sum over its tokens / (B x T); the shares sum to the mean."""
        logits = self(idx, positions)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum") / (
            idx.shape[0] * seq_len
        )

    def sync_grads(self) -> None:
        """Sum every gradient over the sequence group (each rank's is the gradient of its tokens' share)."""
        grads = [p.grad for p in self.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=self.group, label="grads")
        for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(summed.view_as(g))


def shard_batch(x: torch.Tensor, y: torch.Tensor, method: str, group=None):
    """This rank's (idx, targets, positions) of a global batch x, y [B, T] for a sequence-sharded method."""
    rank, P, T = comm.group_rank(group), comm.group_size(group), x.shape[1]
    layout = "zigzag" if method == "ring-zigzag" else "contiguous"
    positions = torch.arange(T, device=x.device)
    return tuple(sequence_split(t, rank, P, dim=t.dim() - 1, layout=layout) for t in (x, y, positions))


# ---------------------------------------------------------------------------------------- the training loop


def train_sequence_parallel(model, optimizer, batches) -> dict:
    """Rank code: train `model` (MegatronSPGPT or SequenceShardedGPT) on `batches` of global (x, y) [B, T]: the
    tensor-parallel loop (every rank sees the whole batch), with a sequence-sharded model's loss taken on this
    rank's tokens, and after each backward the gradients the ranks' token shares gave summed (`sync_grads`).
    Returns the loss (this rank's share for a sequence-sharded model, the whole for Megatron SP), the first
    step's gradients and the final parameters (this rank's slices), and the parameter bytes held."""

    def loss_fn(model, x, y):
        if isinstance(model, SequenceShardedGPT):
            idx, targets, positions = shard_batch(x, y, model.method, model.group)  # this rank's tokens
            return model.loss(idx, targets, positions, x.shape[1])
        return model.loss(x, y)

    return train_tensor_parallel(model, optimizer, batches, loss_fn=loss_fn, grad_sync=model.sync_grads)


# ------------------------------------------------------------------------------------------------- the theory


def wire_bytes(kind: str, payload: int, world_size: int) -> int:
    """Bytes one rank sends for a collective with parlab.core.comm's `payload`, with the ring algorithms:
    all-reduce 2(P-1)/P x N; reduce-scatter (payload N) (P-1)/P x N; all-gather (payload N/P) (P-1) x N/P."""
    P = world_size
    if kind == "all_reduce":
        return 2 * (P - 1) * payload // P
    if kind == "reduce_scatter":
        return (P - 1) * payload // P
    if kind == "all_gather":
        return (P - 1) * payload
    raise ValueError(f"no ring formula for {kind!r}")


def megatron_sp_layer_theory(cfg: GPTConfig, batch: int, world_size: int) -> dict[str, int]:
    """Payload per rank per training step in the L blocks (bytes): per block 2 all-gathers and 2 reduce-scatters
    forward, and the same backward (the conjugates). all-gather: this rank's [B, T/P, H]; reduce-scatter: [B, T, H].
    Full recomputation reruns each block's forward up to its last kept tensor: 2 all-gathers and the attention's
    reduce-scatter more per layer."""
    BTH, L = batch * cfg.seq_len * cfg.hidden * cfg.dtype_bytes, cfg.layers
    ag, rs = (6, 5) if cfg.recompute == "full" else (4, 4)
    return {"all_gather": ag * L * BTH // world_size, "reduce_scatter": rs * L * BTH}


def ulysses_theory(cfg: GPTConfig, batch: int, world_size: int) -> int:
    """All-to-all payload per rank per training step: 8 calls per block (q, k, v, out; forward and backward)."""
    one = a2a_bytes_per_call(batch, cfg.heads, cfg.seq_len, cfg.head_size, world_size, cfg.dtype_bytes)
    return 8 * cfg.layers * one


def ring_theory(cfg: GPTConfig, batch: int, world_size: int) -> dict[str, int]:
    """Sends per rank per training step, and their bytes: per block P-1 K/V blocks forward, P-1 K/V blocks and
    P dK/dV blocks backward (none at P = 1)."""
    P, L = world_size, cfg.layers
    block = kv_block_bytes(batch, cfg.heads, cfg.seq_len, cfg.head_size, P, cfg.dtype_bytes)
    if P == 1:
        return {"kv fwd": 0, "kv bwd": 0, "dkv bwd": 0, "block": block}
    return {"kv fwd": L * (P - 1) * block, "kv bwd": L * (P - 1) * block, "dkv bwd": L * P * block, "block": block}


def grad_sync_theory(cfg: GPTConfig, method: str, world_size: int) -> int:
    """All-reduce payload of the gradient sum per step: every parameter (Ulysses, ring), or the parameters
    Megatron SP uses on T/P tokens (LayerNorms, wpe, row-parallel biases)."""
    H, L = cfg.hidden, cfg.layers
    if method == "megatron-sp":
        return (L * (4 * H + 2 * H) + cfg.seq_len * H + 2 * H) * cfg.dtype_bytes
    return tensor_bytes(build_model(cfg).parameters())  # host: counted
