"""The pieces parlab/schemes/hybrid/train.py composes: one pipeline stage of the GPT with TP (+ SP) and CP inside, and
ZeRO
for a pipeline's micro-batches.

A rank of the mesh (pp, dp, cp, tp) holds pipeline stage s = its pp index (or several: interleaved), and of that
stage's weights its tp slice (parlab/schemes/tensor_parallel.py); it runs them on its dp replica's rows of the batch
and, of those rows, on its cp block of the sequence (parlab/schemes/sequence/ring_attention.py,
parlab/schemes/sequence/ulysses.py). Shapes on a rank:

    token ids           [b, T/cp]           b = B / (dp m) rows of a micro-batch; T/cp tokens (zigzag: 2 chunks)
    residual stream     [b, T/cp, H]        with SP: [b, T/(cp tp), H], the tp group's sequence split once more
    q, k, v             [b, nh/tp, T/cp, hs]   this rank's heads (TP) of its tokens (CP): attention over cp
    logits              [b, T/cp, V/tp]     this rank's vocabulary columns (TP), loss by three all-reduces

Every block below is a building block of the single schemes, handed its axis' process group: nothing here
talks by itself except Megatron SP's LayerNorm-gradient sum (`sp_grad_sync`) and ZeRO's per-micro-batch
reduce-scatter (`PipelineZeRO`), both through parlab.core.comm on a named group.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlab.core import comm
from parlab.core.models import GPT, Block, causal_attention, lm_loss
from parlab.core.moe import MoE
from parlab.schemes.hybrid.experts import hybrid_moe, moe_forward
from parlab.schemes.pipeline.executor import Boundary
from parlab.schemes.sequence.ring_attention import ring_attention, sequence_split
from parlab.schemes.sequence.sequence_parallel import (
    SequenceParallelEmbedding,
    SequenceParallelRowLinear,
    gather_from_sequence_parallel,
)
from parlab.schemes.sequence.ulysses import ulysses_attention
from parlab.schemes.sequence.usp import usp_attention
from parlab.schemes.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from parlab.schemes.zero.stages import ZeRO

CP_METHODS = ("ring", "zigzag", "ulysses", "usp")


@dataclass
class Axes:
    """What a stage needs to know of the mesh: the tp and cp groups, their sizes and this rank's place in them;
    with USP the cp group's ulysses and ring sub-groups, with experts the ep group (None: all experts here)."""

    tp: int = 1
    cp: int = 1
    tp_group: object = None
    cp_group: object = None
    tp_rank: int = 0
    cp_rank: int = 0
    sequence_parallel: bool = False
    cp_method: str = "ring"
    ulysses_group: object = None
    ring_group: object = None
    ep_group: object = None

    @property
    def layout(self) -> str:
        return "zigzag" if self.cp_method == "zigzag" else "contiguous"


def positions_of(seq_len: int, axes: Axes) -> torch.Tensor:
    """The sequence positions of this rank's tokens: its cp block (contiguous or zigzag), and with SP its tp
    piece of that block (the SP embedding reduce-scatters the block into tp contiguous pieces)."""
    positions = torch.arange(seq_len)  # host: an index list, moved where it is used
    mine = sequence_split(positions, axes.cp_rank, axes.cp, dim=0, layout=axes.layout)  # [T/cp]
    return mine.chunk(axes.tp)[axes.tp_rank] if axes.sequence_parallel else mine  # SP: [T/(cp tp)]


def _mark_sequence_split(module: nn.Module) -> nn.Module:
    """SP: a replicated module used on this rank's T/tp tokens only: its gradients are partial sums over tp."""
    for p in module.parameters():
        p.sequence_parallel = True
    return module


class HybridBlock(nn.Module):
    """parlab.core.models.Block (same parameter names) on this rank's heads (tp) and tokens (cp).

    x: [b, T/cp, H] (SP: [b, T/(cp tp), H]). Entering attention and the MLP: Megatron's f (SP: an all-gather over
    tp along the sequence); q, k, v and fc column-parallel; attention of this rank's heads over the cp group's
    whole sequence; attn.proj and mlp.proj row-parallel with g (SP: a reduce-scatter). With tp = 1 the layers are
    the reference's own (copies), with cp = 1 attention is the reference's.
    """

    def __init__(self, full: Block, index: int, axes: Axes):
        super().__init__()
        self.index, self.axes = index, axes
        sp, tp = axes.sequence_parallel, axes.tp
        self.ln1, self.ln2 = copy.deepcopy(full.ln1), copy.deepcopy(full.ln2)
        if sp:
            _mark_sequence_split(self.ln1), _mark_sequence_split(self.ln2)
        self.attn, self.mlp = nn.Module(), nn.Module()
        label = f"attn {index}"  # q, k, v column-parallel (this rank's heads), proj row-parallel
        self.attn.q, self.attn.k, self.attn.v = (self._column(getattr(full.attn, n), label) for n in ("q", "k", "v"))
        self.attn.proj = self._row(full.attn.proj, label)
        self.moe = isinstance(full.mlp, MoE)
        if self.moe:  # the router and this rank's E/ep experts (of the ep group), replicated over tp
            self.mlp = hybrid_moe(full.mlp, axes.ep_group, f"L{index}")
        else:  # fc column-parallel (this rank's FFN units), proj row-parallel
            label = f"mlp {index}"
            self.mlp.fc, self.mlp.proj = self._column(full.mlp.fc, label), self._row(full.mlp.proj, label)
        self.heads, self.head_size = full.attn.heads // tp, full.attn.q.out_features // full.attn.heads  # nh/tp, hs

    def _column(self, full: nn.Linear, label: str) -> nn.Module:
        a = self.axes
        if a.tp == 1:
            return copy.deepcopy(full)
        return ColumnParallelLinear(full, copy_input=False, label=label, group=a.tp_group)  # f applied once, below

    def _row(self, full: nn.Linear, label: str) -> nn.Module:
        a = self.axes
        if a.tp == 1:
            return copy.deepcopy(full)
        kind = SequenceParallelRowLinear if a.sequence_parallel else RowParallelLinear  # g-bar or g
        return kind(full, label=label, group=a.tp_group)

    def _enter(self, h: torch.Tensor, label: str) -> torch.Tensor:
        """Into a tensor-parallel region: f (identity fwd, all-reduce bwd) or SP's all-gather along T."""
        a = self.axes
        if a.tp == 1:
            return h
        if a.sequence_parallel:
            return gather_from_sequence_parallel(h, label, a.tp_group)  # [b, T/(cp tp), H] -> [b, T/cp, H]
        return copy_to_tensor_parallel(h, label, a.tp_group)

    def _attend(self, q, k, v) -> torch.Tensor:
        """This rank's heads over the whole sequence: q, k, v [b, nh/tp, T/cp, hs] -> same shape."""
        a, label = self.axes, f"attn {self.index}"
        if a.cp == 1:
            return causal_attention(q, k, v)
        if a.cp_method == "ulysses":
            return ulysses_attention(q, k, v, causal=True, group=a.cp_group, label=label)
        if a.cp_method == "usp":  # all-to-all over the ulysses sub-axis, ring over the ring sub-axis, and back
            return usp_attention(
                q,
                k,
                v,
                causal=True,
                ulysses_group=a.ulysses_group,
                ring_group=a.ring_group,
                layout="contiguous",
                label=label,
            )
        return ring_attention(q, k, v, causal=True, group=a.cp_group, layout=a.layout, label=label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._enter(self.ln1(x), f"attn {self.index}")  # [b, T/cp, H]
        b, T, _ = h.shape

        def split_heads(t):  # [b, T/cp, H/tp] -> [b, nh/tp, T/cp, hs]
            return t.view(b, T, self.heads, self.head_size).transpose(1, 2)

        at = self.attn
        y = self._attend(split_heads(at.q(h)), split_heads(at.k(h)), split_heads(at.v(h)))
        x = x + at.proj(y.transpose(1, 2).reshape(b, T, -1))  # g (or g-bar) inside: [b, T/cp, H] (SP: T/(cp tp))
        if self.moe:  # every tp rank holds the same tokens: no f, no g
            return x + moe_forward(self.mlp, self.ln2(x))  # [b, T/cp, H], the ep group's all-to-alls inside
        h = self._enter(self.ln2(x), f"mlp {self.index}")
        return x + self.mlp.proj(F.gelu(self.mlp.fc(h)))  # [b, T/cp, F/tp] -> g -> [b, T/cp, H]


class HybridStage(nn.Module):
    """Pipeline stage `index` of `num_stages` (blocks `layers`) of the reference GPT, built from it with this
    rank's tp slices and cp attention. Stage 0 embeds token ids [b, T/cp]; the last stage returns logits
    [b, T/cp, V/tp]; between them travel [b, T/cp, H] (SP: [b, T/(cp tp), H], packed as `boundary` says).

    `named`: the reference model's names of the parameters held here. `loss_fn(logits, targets)`: the mean loss
    over this rank's tokens (vocab-parallel over tp); the cp and dp ranks' means average to the batch's mean.
    """

    def __init__(self, full: GPT, index: int, num_stages: int, layers: range, axes: Axes):
        super().__init__()
        cfg, tp, sp = full.cfg, axes.tp, axes.sequence_parallel
        self.cfg, self.axes, self.index, self.layers = cfg, axes, index, layers
        self.first, self.last = index == 0, index == num_stages - 1
        self.boundary = Boundary(cfg.hidden // tp if sp else cfg.hidden, cfg.torch_dtype)
        named = {}
        if self.first:
            if tp == 1:
                self.wte = copy.deepcopy(full.wte)
            else:
                kind = SequenceParallelEmbedding if sp else VocabParallelEmbedding
                self.wte = kind(full.wte, axes.tp_group)
            self.wpe = copy.deepcopy(full.wpe)
            if sp:
                _mark_sequence_split(self.wpe)
            named |= {"wte.weight": self.wte.weight, "wpe.weight": self.wpe.weight}
        self.blocks = nn.ModuleList(HybridBlock(full.blocks[i], i, axes) for i in layers)
        for i, block in zip(layers, self.blocks, strict=True):
            named |= {f"blocks.{i}.{n}": p for n, p in block.named_parameters()}
        if self.last:
            self.ln_f = _mark_sequence_split(copy.deepcopy(full.ln_f)) if sp else copy.deepcopy(full.ln_f)
            if tp == 1:
                self.lm_head = copy.deepcopy(full.lm_head)
            else:  # column-parallel over the vocabulary; f inside unless SP's all-gather comes first
                self.lm_head = ColumnParallelLinear(
                    full.lm_head, copy_input=not sp, label="lm_head", group=axes.tp_group
                )
            if cfg.tied:  # the same [V/tp, H] rows serve as embedding and head (pp = 1 only)
                self.lm_head.weight = self.wte.weight
            named |= {"ln_f.weight": self.ln_f.weight, "ln_f.bias": self.ln_f.bias}
            if not cfg.tied:
                named["lm_head.weight"] = self.lm_head.weight
        self.named = named
        for p in self.parameters():  # what TP does not split is replicated
            if not hasattr(p, "tp_split_dim"):
                p.tp_split_dim = None

    def layer_modules(self) -> list[nn.Module]:
        """The stage's layers in order (ZeRO's units): embeddings, blocks, final LayerNorm, LM head."""
        first = [self.wte, self.wpe] if self.first else []
        last = [self.ln_f] + ([] if self.cfg.tied else [self.lm_head]) if self.last else []
        return first + list(self.blocks) + last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, H = self.axes, self.cfg.hidden
        if self.first:  # [b, T/cp] token ids -> [b, T/cp, H] (SP: the embedding reduce-scatters to T/(cp tp))
            x = self.wte(x) + self.wpe(positions_of(self.cfg.seq_len, a).to(x.device))
        elif a.sequence_parallel:
            x = x.view(x.shape[0], -1, H)  # the received [b, T/cp, H/tp] buffer holds [b, T/(cp tp), H]
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x.reshape(x.shape[0], -1, self.boundary.width) if a.sequence_parallel else x
        h = self.ln_f(x)
        if a.sequence_parallel:
            h = gather_from_sequence_parallel(h, "lm_head", a.tp_group)  # [b, T/cp, H]
        return self.lm_head(h)  # [b, T/cp, V/tp]

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss over this rank's tokens. logits [b, T/cp, V/tp], targets [b, T/cp] -> scalar."""
        if self.axes.tp == 1:
            return lm_loss(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.wte_vocab_start, self.axes.tp_group)

    @property
    def wte_vocab_start(self) -> int:
        """The first token id of this rank's vocabulary columns (its LM head rows): tp rank x V/tp."""
        return self.axes.tp_rank * self.cfg.vocab_size // self.axes.tp


# --------------------------------------------------------------------------------- Megatron SP's gradient sum


def sequence_split_params(modules) -> list[nn.Parameter]:
    """The parameters SP uses on this rank's T/tp tokens only (LayerNorms, wpe, row-parallel biases)."""
    return [p for m in modules for p in m.parameters() if getattr(p, "sequence_parallel", False)]


def sp_grad_sync(params: list[nn.Parameter], group) -> None:
    """Sum the partial gradients of SP's sequence-split parameters over the tp group: one flat all-reduce."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group, label="sp grads")
    for p, g, summed in zip(params, grads, flat.split([g.numel() for g in grads]), strict=True):
        if p.grad is None:
            p.grad = g
        p.grad.copy_(summed.view_as(p))  # in place: ZeRO-1's .grad are views of its flat buffers


def sp_grad_hooks(params: list[nn.Parameter], group) -> list:
    """ZeRO-2/3 reduce-scatter each gradient as soon as it is complete, so SP's sum over tp must come first:
    an all-reduce of each sequence-split gradient as it is accumulated (per micro-batch), before ZeRO's hook."""

    def hook(p: torch.Tensor) -> None:
        comm.all_reduce(p.grad, group=group, label="sp grads")

    return [p.register_post_accumulate_grad_hook(hook) for p in params]


# ---------------------------------------------------------------------------------- ZeRO over micro-batches


class PipelineZeRO(ZeRO):
    """ZeRO stage 2 or 3 (parlab/schemes/zero/stages.py) when one step runs m micro-batches (a pipeline, or
    accumulation): each unit is reduce-scattered every time its gradients are complete, once per micro-batch, and
    rank r's shard of the sum accumulates in `grad_shard` [S] (ReduceScatterGrads with accumulate=True). Stage 3
    also gathers a unit's parameters before each of its m forwards and m backwards, and frees them after each of
    its backwards."""

    accumulate = True
