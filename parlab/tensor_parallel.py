"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): split each weight matrix across ranks.

Every rank sees the whole batch and holds a slice of every big weight. Megatron writes a linear layer as
Y = X A with A: [in, out]; torch stores W = A^T: [out, in]. Two ways to split the GEMM over P ranks:

    column-parallel  A = [A_0 | A_1 | ... ]   rank r holds A's columns [r*out/P, (r+1)*out/P) = rows of W (dim 0)
                     Y_r = X A_r              X replicated, Y split by columns: no communication in the forward
    row-parallel     A = [A_0; A_1; ...]      rank r holds A's rows [r*in/P, (r+1)*in/P) = columns of W (dim 1)
                     Y = sum_r X_r A_r        X split by columns, the partial products summed by an all-reduce

A column-parallel layer followed by a row-parallel one needs no communication in between: the output columns
of the first are exactly the input columns of the second. That is the Megatron MLP (fc column, proj row) and
the Megatron attention (q, k, v column, so every rank owns heads/P whole heads; proj row). Megatron's two
conjugate operators (its Figure 3) mark where the ranks talk:

    f: identity in the forward, all-reduce of the gradient in the backward   (entering a parallel region)
    g: all-reduce in the forward, identity in the backward                   (leaving it)

so each transformer layer costs 2 all-reduces forward (g after attention, g after the MLP) and 2 backward (f
before each), each of B x T x H elements. The vocabulary is split the same way: rank r holds the embedding rows
and LM-head rows of tokens [r*V/P, (r+1)*V/P), and the cross-entropy is computed from three all-reduces of
B x T numbers (max, sum of exponentials, target logit) without ever gathering the [B, T, V] logits (the naive
loss that gathers them, `naive_vocab_cross_entropy`, sits beside it for comparison).

Everything outside the f ... g regions (LayerNorms, position embedding, residual adds, the biases of the
row-parallel layers) is computed identically on every rank: replicated.

Shapes: B batch, T sequence, H hidden, F FFN size, V vocabulary, nh heads, hs = H / nh, P = world size.

`python -m parlab run tp --world 4` runs the scheme below, and `run_tp` (at the end) runs it from a notebook.
Lesson 02 (notebooks/02_tensor_parallel.ipynb) takes its demos and figures (the C = A B split, the layer-by-layer
checks, parameter memory) from parlab/lessons/tensor_parallel.py, which builds them from this file.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parlab import comm
from parlab.check import CountCheck, Verdict, check_equal, compare
from parlab.launch import Results, device
from parlab.models import (
    GPT,
    MLP,
    GPTConfig,
    SelfAttention,
    build_model,
    causal_attention,
    lm_loss,
    make_batches,
    make_optimizer,
    param_bytes,
    train_single_device,
)
from parlab.schemes import Scheme, launch_scheme


def _world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): the ones given, else this process's ((0, 1) outside torch.distributed)."""
    r, P = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return (r if rank is None else rank), (P if world_size is None else world_size)


# ------------------------------------------------------------------------------- Megatron's f and g operators


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward.

    Put in front of a parallel region whose input X is replicated. Each rank computes only its part of the
    region, so each rank's dL/dX is a partial sum; the backward all-reduces it into the full dL/dX.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, label: str) -> torch.Tensor:
        ctx.label = label
        return x.view_as(x)  # the same values: every rank already has all of X

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # our own buffer: the all-reduce writes in place
        comm.all_reduce(grad, label=f"f bwd {ctx.label}")  # sum of the ranks' partial dL/dX: [B, T, H]
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward.

    Put after a row-parallel layer: each rank holds a partial Y_r, the forward sums them. The sum Y is used
    identically on every rank, so dL/dY is already the same everywhere and the backward passes it through.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, label: str) -> torch.Tensor:
        x = x.contiguous().clone()
        comm.all_reduce(x, label=f"g fwd {label}")  # Y = sum over ranks of Y_r: [B, T, H]
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dim: [..., n/P] on each rank -> [..., n] on every rank.

    The backward keeps this rank's slice of the gradient (the gathered output is used identically on every
    rank, so its gradient is the same everywhere: no communication is needed).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, label: str) -> torch.Tensor:
        rank, P = _world()
        ctx.rank, ctx.P = rank, P
        shard = x.contiguous()  # [..., n/P]
        out = torch.empty((P * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        comm.all_gather_into_tensor(out, shard, label=f"gather fwd {label}")  # the ranks' shards, stacked on dim 0
        stacked = out.view(P, *shard.shape)  # [P, ..., n/P]
        return torch.cat(stacked.unbind(0), dim=-1)  # rank r's slice at columns [r*n/P, (r+1)*n/P): [..., n]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.P, dim=-1)[ctx.rank].contiguous(), None


def copy_to_tensor_parallel(x: torch.Tensor, label: str = "") -> torch.Tensor:
    """f (identity forward, all-reduce backward). x: replicated [B, T, H]."""
    return CopyToTensorParallel.apply(x, label)


def reduce_from_tensor_parallel(x: torch.Tensor, label: str = "") -> torch.Tensor:
    """g (all-reduce forward, identity backward). x: this rank's partial sum; returns the sum, replicated."""
    return ReduceFromTensorParallel.apply(x, label)


def gather_from_tensor_parallel(x: torch.Tensor, label: str = "") -> torch.Tensor:
    """All-gather the last dim. x: [..., n/P] (rank r's columns) -> [..., n] on every rank."""
    return GatherFromTensorParallel.apply(x, label)


def _sharded(tensor: torch.Tensor, dim: int, rank: int, P: int) -> nn.Parameter:
    """Rank r's slice [r*n/P, (r+1)*n/P) of `tensor` along `dim`, as a parameter that remembers the dim."""
    p = nn.Parameter(tensor.detach().chunk(P, dim=dim)[rank].clone())
    p.tp_split_dim = dim  # how to gather it back to full shape (None: replicated)
    return p


def _replicated(tensor: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(tensor.detach().clone())
    p.tp_split_dim = None
    return p


# ------------------------------------------------------------------------------------------ the parallel linears


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r (+ b_r): A split by columns, i.e. rank r holds W's rows [r*out/P, (r+1)*out/P).

    weight: [out/P, in], bias: [out/P] on each rank.
    x: [..., in], replicated -> [..., out/P] (rank r's output columns), or [..., out] if gather_output.
    copy_input: apply f to x here. A block whose several column-parallel layers read the same x (q, k, v)
    applies f once itself, so that the backward sums their dL/dx locally and all-reduces once, not three times.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        copy_input: bool = True,
        label: str = "",
        rank: int | None = None,
        world_size: int | None = None,
    ):
        super().__init__()
        self.rank, self.world_size = _world(rank, world_size)
        if out_features % self.world_size:
            raise ValueError(f"out_features={out_features} is not divisible by world_size={self.world_size}")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.copy_input, self.label = gather_output, copy_input, label
        self.weight = _sharded(torch.zeros(out_features, in_features), 0, self.rank, self.world_size)
        self.bias = _sharded(torch.zeros(out_features), 0, self.rank, self.world_size) if bias else None

    @classmethod
    def from_linear(cls, full: nn.Linear, rank: int | None = None, world_size: int | None = None, **kwargs):
        """This rank's column slice of an unsharded nn.Linear (same values, so the two compare exactly)."""
        layer = cls(
            full.in_features, full.out_features, full.bias is not None, rank=rank, world_size=world_size, **kwargs
        )
        layer.weight = _sharded(full.weight, 0, layer.rank, layer.world_size)  # [out/P, in]
        if full.bias is not None:
            layer.bias = _sharded(full.bias, 0, layer.rank, layer.world_size)  # [out/P]
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tensor_parallel(x, self.label)  # f
        y = F.linear(x, self.weight, self.bias)  # [..., out/P]: rank r's output columns, no communication
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.label)  # [..., out] on every rank
        return y


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r + b: A split by rows, i.e. rank r holds W's columns [r*in/P, (r+1)*in/P).

    weight: [out, in/P] on each rank; bias: [out], replicated (added once, after the sum).
    x: [..., in/P] (rank r's input columns, e.g. a column-parallel layer's output) -> [..., out], replicated.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        label: str = "",
        rank: int | None = None,
        world_size: int | None = None,
    ):
        super().__init__()
        self.rank, self.world_size = _world(rank, world_size)
        if in_features % self.world_size:
            raise ValueError(f"in_features={in_features} is not divisible by world_size={self.world_size}")
        self.in_features, self.out_features, self.label = in_features, out_features, label
        self.weight = _sharded(torch.zeros(out_features, in_features), 1, self.rank, self.world_size)
        self.bias = _replicated(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_linear(cls, full: nn.Linear, rank: int | None = None, world_size: int | None = None, **kwargs):
        """This rank's row slice of an unsharded nn.Linear."""
        layer = cls(
            full.in_features, full.out_features, full.bias is not None, rank=rank, world_size=world_size, **kwargs
        )
        layer.weight = _sharded(full.weight, 1, layer.rank, layer.world_size)  # [out, in/P]
        if full.bias is not None:
            layer.bias = _replicated(full.bias)  # [out]
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # X_r A_r: [..., out], this rank's share of the sum
        y = reduce_from_tensor_parallel(partial, self.label)  # g: sum over ranks, [..., out] replicated
        return y + self.bias if self.bias is not None else y  # the bias once, not P times


# ------------------------------------------------------------------------------------ Megatron MLP and attention


class TensorParallelMLP(nn.Module):
    """Megatron MLP: f, fc column-parallel, GELU, proj row-parallel (with g). 1 all-reduce fwd, 1 bwd.

    Rank r holds fc.weight rows and proj.weight columns [r*F/P, (r+1)*F/P): the FFN units r*F/P... are its own,
    and GELU acts on each unit separately, so nothing is exchanged between the two GEMMs.
    """

    def __init__(self, full: MLP, rank: int | None = None, world_size: int | None = None, label: str = "mlp"):
        super().__init__()
        self.label = label
        self.fc = ColumnParallelLinear.from_linear(full.fc, rank, world_size, copy_input=False, label=label)
        self.proj = RowParallelLinear.from_linear(full.proj, rank, world_size, label=label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H], replicated
        x = copy_to_tensor_parallel(x, self.label)  # f: backward all-reduces dL/dx
        h = F.gelu(self.fc(x))  # [B, T, F/P]: rank r's FFN units
        return self.proj(h)  # g inside: [B, T, H], replicated


class TensorParallelSelfAttention(nn.Module):
    """Megatron attention: f, q/k/v column-parallel (rank r owns heads [r*nh/P, (r+1)*nh/P)), attention on the
    local heads, proj row-parallel (with g). 1 all-reduce fwd, 1 bwd.

    Head h occupies columns [h*hs, (h+1)*hs) of q, k and v, so a column slice of H/P is nh/P whole heads and
    attention needs nothing from the other ranks.
    """

    def __init__(
        self, full: SelfAttention, rank: int | None = None, world_size: int | None = None, label: str = "attn"
    ):
        super().__init__()
        self.label = label
        self.q = ColumnParallelLinear.from_linear(full.q, rank, world_size, copy_input=False, label=label)
        self.k = ColumnParallelLinear.from_linear(full.k, rank, world_size, copy_input=False, label=label)
        self.v = ColumnParallelLinear.from_linear(full.v, rank, world_size, copy_input=False, label=label)
        self.proj = RowParallelLinear.from_linear(full.proj, rank, world_size, label=label)
        if full.heads % self.q.world_size:
            raise ValueError(f"heads={full.heads} is not divisible by world_size={self.q.world_size}")
        self.heads = full.heads // self.q.world_size  # heads on this rank: nh/P
        self.head_size = full.q.out_features // full.heads  # hs

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H], replicated
        B, T, _ = x.shape
        nh, hs = self.heads, self.head_size  # nh here is this rank's nh/P
        x = copy_to_tensor_parallel(x, self.label)  # f, once for q, k and v

        def split_heads(t):  # [B, T, H/P] -> [B, nh/P, T, hs]
            return t.view(B, T, nh, hs).transpose(1, 2)

        y = causal_attention(split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x)))
        y = y.transpose(1, 2).reshape(B, T, nh * hs)  # this rank's heads side by side: [B, T, H/P]
        return self.proj(y)  # g inside: [B, T, H], replicated


# -------------------------------------------------------------------------- vocabulary-parallel embedding and loss


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the embedding rows of tokens [r*V/P, (r+1)*V/P): weight [V/P, H].

    idx: [B, T] token ids (all ranks the same) -> [B, T, H], replicated. Each rank looks up the ids it owns,
    writes zeros for the others, and g sums the ranks' [B, T, H] (1 all-reduce fwd, none bwd).
    """

    def __init__(
        self, full: nn.Embedding, rank: int | None = None, world_size: int | None = None, label: str = "embed"
    ):
        super().__init__()
        rank, P = _world(rank, world_size)
        V = full.num_embeddings
        if V % P:
            raise ValueError(f"vocab={V} is not divisible by world_size={P}")
        self.vocab_start, self.vocab_end = rank * V // P, (rank + 1) * V // P
        self.weight = _sharded(full.weight, 0, rank, P)  # [V/P, H]
        self.label = label

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mine = (idx >= self.vocab_start) & (idx < self.vocab_end)  # [B, T]: ids this rank owns
        local = torch.where(mine, idx - self.vocab_start, 0)  # out-of-range ids point at row 0 ...
        e = F.embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)  # ... and are zeroed: [B, T, H]
        return reduce_from_tensor_parallel(e, self.label)  # g: every id found on exactly one rank


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocabulary-sharded logits, never gathering them.

    logits: [N, V/P], rank r's vocabulary columns [vocab_start, vocab_start + V/P); targets: [N] global ids.
    loss_n = log sum_v exp(z_nv - m_n) - (z_n,target - m_n), with three all-reduces of N numbers:
        m_n = max over all ranks (for stability), sum_v exp(...) over all ranks, the target logit (one rank has it).
    The backward (softmax - one-hot) / N is local: each rank owns its columns of the softmax.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> torch.Tensor:
        N, Vp = logits.shape
        m = logits.max(dim=-1).values  # [N], this rank's max
        comm.all_reduce(m, op=comm.ReduceOp.MAX, label="loss max")  # [N], max over the whole vocabulary
        shifted = logits - m.unsqueeze(-1)  # [N, V/P]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # [N], this rank's share
        comm.all_reduce(sum_exp, label="loss sum-exp")  # [N], over the whole vocabulary
        local = targets - vocab_start
        mine = (local >= 0) & (local < Vp)  # [N]: the targets in this rank's columns
        local = torch.where(mine, local, 0)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)  # [N]
        comm.all_reduce(target_logit, label="loss target logit")  # [N], from the rank that owns each target
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)  # softmax columns [N, V/P]
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        grad = softmax.clone()  # d loss_n / d z_nv = softmax_nv - [v == target_n]
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= mine.to(grad.dtype)
        return grad * (grad_loss / grad.shape[0]), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Mean next-token loss. logits: [B, T, V/P] (rank r's vocabulary columns), targets: [B, T] -> scalar."""
    return VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), vocab_start)


def naive_vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The naive way, for comparison: all-gather the full [B, T, V] logits on every rank, then F.cross_entropy.
    Moves V/P x B x T numbers per rank instead of 3 x B x T."""
    full = gather_from_tensor_parallel(logits, "naive loss")  # [B, T, V] on every rank
    return lm_loss(full, targets)


# ------------------------------------------------------------------------------------ the tensor-parallel GPT


class TensorParallelBlock(nn.Module):
    def __init__(self, full, rank: int | None, world_size: int | None, index: int):
        super().__init__()
        # LayerNorms replicated: their input x is the same on every rank (it comes out of g or the embedding),
        # and dL/d(their output) is the same too (it comes out of f's all-reduce, plus the replicated residual
        # stream), so every rank computes the same gain and bias gradients and no all-reduce is needed.
        self.ln1 = copy.deepcopy(full.ln1)  # this rank's own copy
        self.attn = TensorParallelSelfAttention(full.attn, rank, world_size, label=f"attn {index}")
        self.ln2 = copy.deepcopy(full.ln2)
        self.mlp = TensorParallelMLP(full.mlp, rank, world_size, label=f"mlp {index}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H], replicated
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """parlab.models.GPT, tensor-parallel over P ranks, with the same parameter names.

    Built from the single-device model (`full`, same seed on every rank): each rank keeps its slices.
    Sharded (rank r holds slice r): wte rows, q/k/v and fc rows, attn.proj and mlp.proj columns, lm_head rows.
    Replicated: wpe, LayerNorms, the row-parallel biases. Each parameter says which: `p.tp_split_dim`.
    forward(idx [B, T]) -> logits [B, T, V/P] (rank r's vocabulary columns); loss(idx, targets) -> scalar.
    """

    def __init__(self, full: GPT, rank: int | None = None, world_size: int | None = None):
        super().__init__()
        self.rank, self.world_size = _world(rank, world_size)
        self.cfg = full.cfg
        self.wte = VocabParallelEmbedding(full.wte, self.rank, self.world_size)
        self.wpe = copy.deepcopy(full.wpe)  # replicated, like the LayerNorms (same input and gradient everywhere)
        self.blocks = nn.ModuleList(
            TensorParallelBlock(b, self.rank, self.world_size, i) for i, b in enumerate(full.blocks)
        )
        self.ln_f = copy.deepcopy(full.ln_f)
        # The LM head is column-parallel over the vocabulary: rank r computes logits of its V/P tokens only.
        self.lm_head = ColumnParallelLinear.from_linear(full.lm_head, self.rank, self.world_size, label="lm_head")
        if self.cfg.tied:  # the same [V/P, H] rows serve as embedding and head
            self.lm_head.weight = self.wte.weight
        for p in self.parameters():  # what is not sharded is replicated
            if not hasattr(p, "tp_split_dim"):
                p.tp_split_dim = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # [B, T, H], replicated (1 all-reduce in wte)
        for block in self.blocks:
            x = block(x)  # 2 all-reduces fwd, 2 bwd per block
        return self.lm_head(self.ln_f(x))  # f inside (1 all-reduce bwd): [B, T, V/P]

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(idx), targets, self.wte.vocab_start)  # 3 all-reduces of B x T


def split_dims(model: nn.Module) -> dict[str, int | None]:
    """For each parameter name: the dim it is split along across ranks, or None if replicated."""
    return {name: p.tp_split_dim for name, p in model.named_parameters()}


def gather_full(shards: list[dict[str, torch.Tensor]], dims: dict[str, int | None]) -> dict[str, torch.Tensor]:
    """Full-shape tensors from every rank's slices (done in the parent, untraced): cat along the split dim,
    or rank 0's copy of a replicated one."""
    return {n: shards[0][n] if d is None else torch.cat([s[n] for s in shards], dim=d) for n, d in dims.items()}


# ------------------------------------------------------------------------------------------------- the theory


def dtype_bytes(cfg: GPTConfig) -> int:
    """Bytes of one number of the model's dtype (8 for float64)."""
    return torch.empty(0, dtype=cfg.torch_dtype).element_size()


def allreduce_theory(cfg: GPTConfig, batch: int) -> dict[str, int]:
    """All-reduce payload per rank per training step, by item (bytes). The per-layer items are the 4 x L x B x T
    x H x bytes of the Megatron blocks; the rest is what the vocabulary-parallel embedding, head and loss need."""
    e = dtype_bytes(cfg)
    BTH, BT, L = batch * cfg.seq_len * cfg.hidden * e, batch * cfg.seq_len * e, cfg.layers
    return {
        "g fwd attn": L * BTH,  # one per layer
        "g fwd mlp": L * BTH,
        "f bwd attn": L * BTH,
        "f bwd mlp": L * BTH,
        "g fwd embed": BTH,  # vocab-parallel embedding
        "f bwd lm_head": BTH,  # vocab-parallel LM head
        "loss max": BT,  # vocab-parallel cross-entropy: three [B, T] all-reduces
        "loss sum-exp": BT,
        "loss target logit": BT,
    }


PER_LAYER_ITEMS = ("g fwd attn", "g fwd mlp", "f bwd attn", "f bwd mlp")


def param_bytes_theory(cfg: GPTConfig, world_size: int) -> int:
    """Bytes of parameters one rank holds: sharded parameters / P + replicated ones."""
    H, F_, V, T, L, P = cfg.hidden, cfg.ffn, cfg.vocab_size, cfg.seq_len, cfg.layers, world_size
    sharded = L * (4 * H * H + 3 * H + 2 * F_ * H + F_) + V * H * (1 if cfg.tied else 2)  # attn, mlp, wte, head
    replicated = L * (4 * H + 2 * H) + T * H + 2 * H  # ln1, ln2, two row-parallel biases; wpe; ln_f
    return (sharded // P + replicated) * dtype_bytes(cfg)


def _per_step(total: int, steps: int) -> int | float:
    return total // steps if total % steps == 0 else total / steps


def itemise(trace, steps: int = 1) -> dict[str, list[int | float]]:
    """All-reduce bytes per rank per step, grouped by label with the layer number dropped ("g fwd mlp 1" ->
    "g fwd mlp")."""
    items: dict[str, list[int]] = {}
    for e in trace.select(kind="all_reduce"):
        key = re.sub(r" \d+$", "", e.label)
        items.setdefault(key, [0] * trace.world_size)[e.rank] += e.bytes
    return {k: [_per_step(b, steps) for b in v] for k, v in items.items()}


# ------------------------------------------------------------------------------------------------- the scheme


def config_from(opts: dict) -> GPTConfig:
    return GPTConfig(
        vocab_size=opts["vocab"],
        seq_len=opts["seq"],
        hidden=opts["hidden"],
        heads=opts["heads"],
        layers=opts["layers"],
        ffn=opts["ffn"],
        tied=opts["tied"],
        dtype=opts["dtype"],
    )


def check_options(opts: dict) -> None:
    """Reject what cannot be split, before any process starts."""
    P = opts["world"]
    if P < 1:
        raise ValueError(f"world={P} must be >= 1")
    for key in ("steps", "batch", "layers", "seq"):
        if opts[key] < 1:
            raise ValueError(f"{key}={opts[key]} must be >= 1")
    ffn = opts["ffn"] or 4 * opts["hidden"]
    sizes = {"heads": opts["heads"], "hidden": opts["hidden"], "ffn": ffn, "vocab": opts["vocab"]}
    bad = [f"{name}={n} is not divisible by world_size={P}" for name, n in sizes.items() if n % P]
    if bad:
        raise ValueError("; ".join(bad) + " (tensor parallelism splits each of them across the ranks)")
    config_from(opts)  # the model's own checks (hidden divisible by heads, dtype)


def tp_rank_fn(opts: dict) -> dict:
    """Rank code: train the tensor-parallel GPT for opts["steps"] steps; return this rank's slices."""
    cfg, dev = config_from(opts), device()
    model = TensorParallelGPT(build_model(cfg, opts["seed"])).to(dev)  # same seed everywhere, keep my slices
    opt = make_optimizer(model.parameters(), opts["optimizer"], opts["lr"])
    losses, grads = [], {}
    for step, (x, y) in enumerate(make_batches(cfg, opts["batch"], opts["steps"], opts["seed"])):
        x, y = x.to(dev), y.to(dev)  # the whole batch on every rank: [B, T]
        with comm.span(f"F{step}", kind="forward"):
            loss = model.loss(x, y)
        opt.zero_grad()
        with comm.span(f"B{step}", kind="backward"):
            loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        with comm.span(f"step {step}", kind="optimizer"):
            opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grads": grads,  # first step, this rank's slices
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},  # after the last step
        "split_dims": split_dims(model),
        "param_bytes": param_bytes(model),  # measured from the tensors this rank holds
    }


def tp_report(opts: dict, results: Results) -> dict:
    """Compare with the single-device run; check the all-reduce bytes and parameter bytes against theory."""
    cfg, P, steps = config_from(opts), opts["world"], opts["steps"]
    batches = make_batches(cfg, opts["batch"], steps, opts["seed"])
    ref = train_single_device(cfg, batches, opts["seed"], opts["optimizer"], opts["lr"])
    dims = results[0]["split_dims"]
    grads = gather_full([r["grads"] for r in results], dims)
    params = gather_full([r["params"] for r in results], dims)
    verdicts: list[Verdict | CountCheck] = [
        compare(
            f"loss of each of {steps} steps",
            torch.tensor(results[0]["losses"], dtype=cfg.torch_dtype),
            torch.tensor(ref.losses, dtype=cfg.torch_dtype),
            show=False,
        ),
        compare("every gradient of step 1, gathered to full shape", grads, ref.grads, show=False),
        compare(f"parameters after {steps} {opts['optimizer']} steps, gathered", params, ref.params, show=False),
    ]
    # Replicated parameters need no all-reduce only if every rank really computes the same gradient: count.
    replicated = [n for n, d in dims.items() if d is None]
    differing = sum(
        any(not torch.equal(r["grads"][n], results[0]["grads"][n]) for n in replicated) for r in results[1:]
    )
    verdicts.append(check_equal("ranks whose replicated gradients differ from rank 0's", differing, 0, show=False))

    theory = allreduce_theory(cfg, opts["batch"])
    measured = {item: [0] * P for item in theory} | itemise(results.trace, steps)  # {item: [bytes/step per rank]}
    total = [_per_step(b, steps) for b in results.trace.bytes_per_rank().get("all_reduce", [0] * P)]
    layers_measured = [sum(measured[i][r] for i in PER_LAYER_ITEMS) for r in range(P)]
    layers_theory = sum(theory[i] for i in PER_LAYER_ITEMS)  # 4 x L x B x T x H x bytes
    calls = [_per_step(c, steps) for c in results.trace.count_per_rank("all_reduce")]
    pb, pb_theory = [r["param_bytes"] for r in results], param_bytes_theory(cfg, P)
    # Every rank does the same work: check that, then rank 0's figures against the theory, item by item.
    per_rank = [([measured[i][r] for i in theory], total[r], calls[r], pb[r]) for r in range(P)]
    verdicts.append(
        check_equal(
            "ranks whose all-reduce bytes, calls or parameter bytes differ from rank 0's",
            sum(row != per_rank[0] for row in per_rank),
            0,
            show=False,
        )
    )
    for item, value in theory.items():
        verdicts.append(check_equal(f"all-reduce bytes per step, {item}", measured[item][0], value, show=False))
    verdicts += [
        check_equal(
            f"all-reduce bytes per step in the {cfg.layers} layers (4 x L x B x T x H x {dtype_bytes(cfg)})",
            layers_measured[0],
            layers_theory,
            show=False,
        ),
        check_equal("all-reduce bytes per step in all", total[0], sum(theory.values()), show=False),
        check_equal(
            "all-reduces per step (4 per layer + embed + head + 3 loss)", calls[0], 4 * cfg.layers + 5, show=False
        ),
        check_equal("parameter bytes held by each rank", pb[0], pb_theory, show=False),
    ]

    numeric = [v for v in verdicts if isinstance(v, Verdict)]
    worst = max(numeric, key=lambda v: v.max_abs_err)
    return {
        "scheme": "tp",
        "world_size": P,
        "passed": all(v.passed for v in verdicts),
        "max_abs_err": worst.max_abs_err,
        "tol": worst.tol,
        "comm": {
            **results.trace.bytes_per_rank(),
            "all_reduce_per_step": total,
            "all_reduce_per_step_theory": sum(theory.values()),
            "layers_all_reduce_per_step": layers_measured,
            "layers_all_reduce_per_step_theory": layers_theory,
            "layers_formula": "4 x layers x batch x seq x hidden x dtype bytes",
            "items_per_step": {k: {"measured": measured[k], "theory": v} for k, v in theory.items()},
            "all_reduces_per_step": calls,
        },
        "layers": cfg.layers,
        "hidden": cfg.hidden,
        "heads": cfg.heads,
        "ffn": cfg.ffn,
        "vocab": cfg.vocab_size,
        "seq": cfg.seq_len,
        "batch": opts["batch"],
        "dtype": cfg.dtype,
        "steps": steps,
        "param_bytes_per_rank": pb,
        "param_bytes_per_rank_theory": pb_theory,
        "param_bytes_single_device": param_bytes(build_model(cfg, opts["seed"])),
        "verdicts": [v.line for v in verdicts],
    }


DEFAULTS = {
    "batch": 4,
    "layers": 2,
    "hidden": 32,
    "heads": 4,
    "ffn": 0,
    "vocab": 64,
    "seq": 16,
    "tied": False,
    "optimizer": "sgd",
    "lr": 0.1,
}


def _add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per batch (every rank)")
    parser.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    parser.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    parser.add_argument("--ffn", type=int, default=DEFAULTS["ffn"], help="FFN size (0: 4 x hidden)")
    parser.add_argument("--vocab", type=int, default=DEFAULTS["vocab"])
    parser.add_argument("--seq", type=int, default=DEFAULTS["seq"])
    parser.add_argument("--tied", action="store_true", help="share the embedding matrix with the LM head")
    parser.add_argument(
        "--optimizer",
        choices=["sgd", "adam"],
        default=DEFAULTS["optimizer"],
        help="sgd (default). adam divides by sqrt(v): in float32 it turns last-bit noise in gradients that are "
        "zero in exact arithmetic (k.bias) into full steps, so compare adam in float64",
    )
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])


SCHEMES = [
    Scheme(
        name="tp",
        help="tensor parallel (Megatron): column/row-parallel MLP and attention, vocab-parallel embedding and loss",
        rank_fn=tp_rank_fn,
        report=tp_report,
        add_arguments=_add_arguments,
        check=check_options,
        defaults=DEFAULTS,
    )
]


def run_tp(world_size: int = 4, **opts) -> tuple[Results, dict]:
    """Run the scheme from Python (a notebook): returns (results, report) as `python -m parlab run tp`."""
    return launch_scheme("tp", world=world_size, **opts)
