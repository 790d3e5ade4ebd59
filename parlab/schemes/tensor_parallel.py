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
B x T numbers (max, sum of exponentials, target logit) without ever gathering the [B, T, V] logits.

Everything outside the f ... g regions (LayerNorms, position embedding, residual adds, row-parallel biases) is
computed identically on every rank: replicated.

Shapes: B batch, T sequence, H hidden, F FFN size, V vocabulary, nh heads, hs = H / nh, P = world size. Every
building block takes its process group (`group=`, default all ranks) and reads r and P from it, so that on a mesh
TP runs within a "tp" group. `python -m parlab run tp` checks it (parlab/runs/tensor_parallel.py); lesson 02.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlab.core import comm
from parlab.core.memory import tensor_bytes
from parlab.core.models import GPT, MLP, GPTConfig, SelfAttention, causal_attention, recomputed

# ------------------------------------------------------------------------------- Megatron's f and g operators


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward.

    Put in front of a parallel region whose input X is replicated. Each rank computes only its part of the
    region, so each rank's dL/dX is a partial sum; the backward all-reduces it into the full dL/dX.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, label: str, group) -> torch.Tensor:
        ctx.label, ctx.group = label, group
        return x.view_as(x)  # the same values: every rank already has all of X

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # our own buffer: the all-reduce writes in place
        comm.all_reduce(grad, group=ctx.group, label=f"f bwd {ctx.label}")  # sum of partial dL/dX: [B, T, H]
        return grad, None, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward.

    Put after a row-parallel layer: each rank holds a partial Y_r, the forward sums them. The sum Y is used
    identically on every rank, so dL/dY is already the same everywhere and the backward passes it through.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, label: str, group) -> torch.Tensor:
        x = x.contiguous().clone()
        comm.all_reduce(x, group=group, label=f"g fwd {label}")  # Y = sum over ranks of Y_r: [B, T, H]
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dim: [..., n/P] on each rank -> [..., n] on every rank.

    The backward keeps this rank's slice of the gradient (the gathered output is used identically on every
    rank, so its gradient is the same everywhere: no communication is needed).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, label: str, group) -> torch.Tensor:
        rank, P = comm.group_rank(group), comm.group_size(group)
        ctx.rank, ctx.P = rank, P
        shard = x.contiguous()  # [..., n/P]
        out = torch.empty((P * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        comm.all_gather_into_tensor(out, shard, group=group, label=f"gather fwd {label}")  # shards stacked, dim 0
        stacked = out.view(P, *shard.shape)  # [P, ..., n/P]
        return torch.cat(stacked.unbind(0), dim=-1)  # rank r's slice at columns [r*n/P, (r+1)*n/P): [..., n]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.P, dim=-1)[ctx.rank].contiguous(), None, None


def copy_to_tensor_parallel(x: torch.Tensor, label: str = "", group=None) -> torch.Tensor:
    """f (identity forward, all-reduce backward over `group`). x: replicated [B, T, H]."""
    return CopyToTensorParallel.apply(x, label, group)


def reduce_from_tensor_parallel(x: torch.Tensor, label: str = "", group=None) -> torch.Tensor:
    """g (all-reduce forward over `group`, identity backward). x: this rank's partial sum; returns the sum."""
    return ReduceFromTensorParallel.apply(x, label, group)


def gather_from_tensor_parallel(x: torch.Tensor, label: str = "", group=None) -> torch.Tensor:
    """All-gather the last dim over `group`. x: [..., n/P] (rank r's columns) -> [..., n] on every rank."""
    return GatherFromTensorParallel.apply(x, label, group)


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
    """Y_r = X A_r (+ b_r): A split by columns, i.e. rank r of `group` holds W's rows [r*out/P, (r+1)*out/P).

    Built from the unsharded nn.Linear `full` (the same on every rank): weight [out/P, in], bias [out/P] here.
    x: [..., in], replicated -> [..., out/P] (rank r's output columns), or [..., out] if gather_output.
    copy_input: apply f to x here. A block whose several column-parallel layers read the same x (q, k, v)
    applies f once itself, so that the backward sums their dL/dx locally and all-reduces once, not three times.
    """

    def __init__(self, full: nn.Linear, *, gather_output=False, copy_input=True, label: str = "", group=None):
        super().__init__()
        self.group, self.rank, self.world_size = group, comm.group_rank(group), comm.group_size(group)
        if full.out_features % self.world_size:
            raise ValueError(f"out_features={full.out_features} is not divisible by world_size={self.world_size}")
        self.gather_output, self.copy_input, self.label = gather_output, copy_input, label
        self.weight = _sharded(full.weight, 0, self.rank, self.world_size)  # [out/P, in]
        self.bias = _sharded(full.bias, 0, self.rank, self.world_size) if full.bias is not None else None  # [out/P]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tensor_parallel(x, self.label, self.group)  # f
        y = F.linear(x, self.weight, self.bias)  # [..., out/P]: rank r's output columns, no communication
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.label, self.group)  # [..., out] on every rank
        return y


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r + b: A split by rows, i.e. rank r of `group` holds W's columns [r*in/P, (r+1)*in/P).

    Built from the unsharded nn.Linear `full`: weight [out, in/P] here; bias [out], replicated (added once,
    after the sum). x: [..., in/P] (rank r's input columns, e.g. a column-parallel layer's output) -> [..., out].
    """

    def __init__(self, full: nn.Linear, *, label: str = "", group=None):
        super().__init__()
        self.group, self.rank, self.world_size = group, comm.group_rank(group), comm.group_size(group)
        if full.in_features % self.world_size:
            raise ValueError(f"in_features={full.in_features} is not divisible by world_size={self.world_size}")
        self.label = label
        self.weight = _sharded(full.weight, 1, self.rank, self.world_size)  # [out, in/P]
        self.bias = _replicated(full.bias) if full.bias is not None else None  # [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # X_r A_r: [..., out], this rank's share of the sum
        y = reduce_from_tensor_parallel(partial, self.label, self.group)  # g: sum over ranks, [..., out] replicated
        return y + self.bias if self.bias is not None else y  # the bias once, not P times


# ------------------------------------------------------------------------------------ Megatron MLP and attention


class TensorParallelMLP(nn.Module):
    """Megatron MLP: f, fc column-parallel, GELU, proj row-parallel (with g). 1 all-reduce fwd, 1 bwd.

    Rank r holds fc.weight rows and proj.weight columns [r*F/P, (r+1)*F/P): the FFN units r*F/P... are its own,
    and GELU acts on each unit separately, so nothing is exchanged between the two GEMMs.
    """

    def __init__(self, full: MLP, group=None, label: str = "mlp"):
        super().__init__()
        self.label, self.group = label, group
        self.fc = ColumnParallelLinear(full.fc, group=group, copy_input=False, label=label)
        self.proj = RowParallelLinear(full.proj, group=group, label=label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H], replicated
        x = copy_to_tensor_parallel(x, self.label, self.group)  # f: backward all-reduces dL/dx
        h = F.gelu(self.fc(x))  # [B, T, F/P]: rank r's FFN units
        return self.proj(h)  # g inside: [B, T, H], replicated


class TensorParallelSelfAttention(nn.Module):
    """Megatron attention: f, q/k/v column-parallel (rank r owns heads [r*nh/P, (r+1)*nh/P)), attention on the
    local heads, proj row-parallel (with g). 1 all-reduce fwd, 1 bwd.

    Head h occupies columns [h*hs, (h+1)*hs) of q, k and v, so a column slice of H/P is nh/P whole heads and
    attention needs nothing from the other ranks.
    """

    def __init__(self, full: SelfAttention, group=None, label: str = "attn"):
        super().__init__()
        self.label, self.group = label, group
        self.q = ColumnParallelLinear(full.q, group=group, copy_input=False, label=label)
        self.k = ColumnParallelLinear(full.k, group=group, copy_input=False, label=label)
        self.v = ColumnParallelLinear(full.v, group=group, copy_input=False, label=label)
        self.proj = RowParallelLinear(full.proj, group=group, label=label)
        if full.heads % self.q.world_size:
            raise ValueError(f"heads={full.heads} is not divisible by world_size={self.q.world_size}")
        self.heads, self.head_size = full.heads // self.q.world_size, full.q.out_features // full.heads  # nh/P, hs
        self.recompute_core = full.recompute_core  # selective recomputation (parlab/schemes/recompute/measure.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H], replicated
        B, T, _ = x.shape
        nh, hs = self.heads, self.head_size  # nh here is this rank's nh/P
        x = copy_to_tensor_parallel(x, self.label, self.group)  # f, once for q, k and v

        def split_heads(t):  # [B, T, H/P] -> [B, nh/P, T, hs]
            return t.view(B, T, nh, hs).transpose(1, 2)

        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        y = recomputed(causal_attention, q, k, v) if self.recompute_core else causal_attention(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, nh * hs)  # this rank's heads side by side: [B, T, H/P]
        return self.proj(y)  # g inside: [B, T, H], replicated


# -------------------------------------------------------------------------- vocabulary-parallel embedding and loss


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the embedding rows of tokens [r*V/P, (r+1)*V/P): weight [V/P, H].

    idx: [B, T] token ids (all ranks the same) -> [B, T, H], replicated. Each rank looks up the ids it owns,
    writes zeros for the others, and g sums the ranks' [B, T, H] (1 all-reduce fwd, none bwd).
    """

    def __init__(self, full: nn.Embedding, group=None, label: str = "embed"):
        super().__init__()
        self.group, self.label = group, label
        rank, P, V = comm.group_rank(group), comm.group_size(group), full.num_embeddings
        if V % P:
            raise ValueError(f"vocab={V} is not divisible by world_size={P}")
        self.vocab_start, self.vocab_end = rank * V // P, (rank + 1) * V // P
        self.weight = _sharded(full.weight, 0, rank, P)  # [V/P, H]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mine = (idx >= self.vocab_start) & (idx < self.vocab_end)  # [B, T]: ids this rank owns
        local = torch.where(mine, idx - self.vocab_start, 0)  # out-of-range ids point at row 0 ...
        e = F.embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)  # ... and are zeroed: [B, T, H]
        return reduce_from_tensor_parallel(e, self.label, self.group)  # g: every id found on exactly one rank


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocabulary-sharded logits, never gathering them.

    logits: [N, V/P], rank r's vocabulary columns [vocab_start, vocab_start + V/P); targets: [N] global ids.
    loss_n = log sum_v exp(z_nv - m_n) - (z_n,target - m_n), with three all-reduces of N numbers:
        m_n = max over all ranks (for stability), sum_v exp(...) over all ranks, the target logit (one rank has it).
    The backward (softmax - one-hot) / N is local: each rank owns its columns of the softmax.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
        N, Vp = logits.shape
        m = logits.max(dim=-1).values  # [N], this rank's max
        comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group, label="loss max")  # [N], max over the vocabulary
        shifted = logits - m.unsqueeze(-1)  # [N, V/P]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # [N], this rank's share
        comm.all_reduce(sum_exp, group=group, label="loss sum-exp")  # [N], over the whole vocabulary
        local = targets - vocab_start
        mine = (local >= 0) & (local < Vp)  # [N]: the targets in this rank's columns
        local = torch.where(mine, local, 0)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)  # [N]
        comm.all_reduce(target_logit, group=group, label="loss target logit")  # [N], from the rank owning each
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)  # softmax columns [N, V/P]
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        grad = softmax.clone()  # d loss_n / d z_nv = softmax_nv - [v == target_n]
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= mine.to(grad.dtype)
        return grad * (grad_loss / grad.shape[0]), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group=None
) -> torch.Tensor:
    """Mean next-token loss. logits: [B, T, V/P] (rank r's vocabulary columns), targets: [B, T] -> scalar."""
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    return VocabParallelCrossEntropy.apply(flat_logits, flat_targets, vocab_start, group)


# ------------------------------------------------------------------------------------ the tensor-parallel GPT


class TensorParallelBlock(nn.Module):
    def __init__(self, full, index: int, group=None):
        super().__init__()
        # LayerNorms replicated: their input x is the same on every rank (it comes out of g or the embedding),
        # and dL/d(their output) is the same too (it comes out of f's all-reduce, plus the replicated residual
        # stream), so every rank computes the same gain and bias gradients and no all-reduce is needed.
        self.ln1 = copy.deepcopy(full.ln1)  # this rank's own copy
        self.attn = TensorParallelSelfAttention(full.attn, group, label=f"attn {index}")
        self.ln2 = copy.deepcopy(full.ln2)
        self.mlp = TensorParallelMLP(full.mlp, group, label=f"mlp {index}")
        self.recompute_all = (
            full.recompute_all
        )  # full recomputation (parlab/schemes/recompute/measure.py): reruns g in the backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H], replicated
        return recomputed(self.layer, x) if self.recompute_all else self.layer(x)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """parlab.core.models.GPT, tensor-parallel over P ranks, with the same parameter names.

    Built from the single-device model (`full`, same seed on every rank): rank r of `group` keeps its slices.
    Sharded (rank r holds slice r): wte rows, q/k/v and fc rows, attn.proj and mlp.proj columns, lm_head rows.
    Replicated: wpe, LayerNorms, the row-parallel biases. Each parameter says which: `p.tp_split_dim`.
    forward(idx [B, T]) -> logits [B, T, V/P] (rank r's vocabulary columns); loss(idx, targets) -> scalar.
    """

    def __init__(self, full: GPT, group=None):
        super().__init__()
        self.group, self.rank, self.world_size = group, comm.group_rank(group), comm.group_size(group)
        self.cfg = full.cfg
        self.wte = VocabParallelEmbedding(full.wte, group)
        self.wpe = copy.deepcopy(full.wpe)  # replicated, like the LayerNorms (same input and gradient everywhere)
        self.blocks = nn.ModuleList(TensorParallelBlock(b, i, group) for i, b in enumerate(full.blocks))
        self.ln_f = copy.deepcopy(full.ln_f)
        # The LM head is column-parallel over the vocabulary: rank r computes logits of its V/P tokens only.
        self.lm_head = ColumnParallelLinear(full.lm_head, group=group, label="lm_head")
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
        return self.loss_from_logits(self(idx), targets)

    def loss_from_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss from this rank's vocabulary columns of the logits: 3 all-reduces of B x T numbers."""
        return vocab_parallel_cross_entropy(logits, targets, self.wte.vocab_start, self.group)


def split_dims(model: nn.Module) -> dict[str, int | None]:
    """For each parameter name: the dim it is split along across ranks, or None if replicated."""
    return {name: getattr(p, "tp_split_dim", None) for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------- the training loop


def train_tensor_parallel(
    model: TensorParallelGPT,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_fn=None,
    grad_sync=None,
) -> dict:
    """Rank code: train this rank's slices of the GPT on the whole of every batch (x, y: [B, T], the same on every
    rank of the model's group). loss_fn(model, x, y): default model.loss(x, y). grad_sync: called after each
    backward (sequence parallelism sums there the gradients of the parameters used on each rank's tokens).
    Returns the losses, the first step's gradients and the final parameters (this rank's slices), how each
    parameter is split, and the parameter bytes this rank holds (measured)."""
    loss_fn = loss_fn or (lambda model, x, y: model.loss(x, y))
    losses, grads = [], {}
    for step, (x, y) in enumerate(batches):
        with comm.span(f"F{step}", kind="forward", step=step):
            loss = loss_fn(model, x, y)
        optimizer.zero_grad()
        with comm.span(f"B{step}", kind="backward", step=step):
            loss.backward()
            if grad_sync is not None:
                grad_sync()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        with comm.span(f"step {step}", kind="optimizer", step=step):
            optimizer.step()
        losses.append(loss.item())
        comm.progress(step + 1, len(batches))
    return {
        "losses": losses,
        "grads": grads,  # first step, this rank's slices
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},  # after the last step
        "split_dims": split_dims(model),
        "param_bytes": tensor_bytes(model.parameters()),  # measured from the tensors this rank holds
    }


# ------------------------------------------------------------------------------------------------- the theory

PER_LAYER_ITEMS = ("g fwd attn", "g fwd mlp", "f bwd attn", "f bwd mlp")  # each Megatron block's 4 all-reduces


def allreduce_theory(cfg: GPTConfig, batch: int) -> dict[str, int]:
    """All-reduce payload per rank per training step, by item (bytes). The per-layer items are the 4 x L x B x T
    x H x bytes of the Megatron blocks; the rest is what the vocabulary-parallel embedding, head and loss need."""
    e = cfg.dtype_bytes
    BTH, BT, L = batch * cfg.seq_len * cfg.hidden * e, batch * cfg.seq_len * e, cfg.layers
    return {
        **dict.fromkeys(PER_LAYER_ITEMS, L * BTH),  # one of each per layer
        "g fwd attn": L * BTH * (2 if cfg.recompute == "full" else 1),  # full recomputation reruns it in the bwd
        "g fwd embed": BTH,  # vocab-parallel embedding
        "f bwd lm_head": BTH,  # vocab-parallel LM head
        # vocab-parallel cross-entropy: three [B, T] all-reduces
        **dict.fromkeys(("loss max", "loss sum-exp", "loss target logit"), BT),
    }


def param_bytes_theory(cfg: GPTConfig, world_size: int) -> int:
    """Bytes of parameters one rank holds: sharded parameters / P + replicated ones."""
    H, F_, V, T, L, P = cfg.hidden, cfg.ffn, cfg.vocab_size, cfg.seq_len, cfg.layers, world_size
    sharded = L * (4 * H * H + 3 * H + 2 * F_ * H + F_) + V * H * (1 if cfg.tied else 2)  # attn, mlp, wte, head
    replicated = L * (4 * H + 2 * H) + T * H + 2 * H  # ln1, ln2, two row-parallel biases; wpe; ln_f
    return (sharded // P + replicated) * cfg.dtype_bytes


def split_sizes(cfg: GPTConfig) -> dict[str, int]:
    """The sizes tensor parallelism splits across the ranks: each must be divisible by P."""
    return {"heads": cfg.heads, "hidden": cfg.hidden, "ffn": cfg.ffn, "vocab": cfg.vocab_size}


def gather_full(shards: list[dict[str, torch.Tensor]], dims: dict[str, int | None]) -> dict[str, torch.Tensor]:
    """Full-shape tensors from every rank's slices (done in the parent, untraced): cat along the split dim,
    or rank 0's copy of a replicated one."""
    return {n: shards[0][n] if d is None else torch.cat([s[n] for s in shards], dim=d) for n, d in dims.items()}
