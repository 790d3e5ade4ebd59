"""DeepSpeed-Ulysses (Jacobs et al. 2023): attention over a sequence split across ranks, by an all-to-all.

Each rank holds a block of the sequence with every head: q, k, v [B, nh, T/P, hs]. Attention needs the whole
sequence, but each head is independent. So an all-to-all transposes the shards: afterwards rank r holds the
whole sequence for heads [r*nh/P, (r+1)*nh/P): [B, nh/P, T, hs]. Each rank runs ordinary attention on its heads,
and a second all-to-all transposes back to [B, nh, T/P, hs].

    before: rank r holds (sequence block r, all heads)       after: rank r holds (all sequence blocks, head group r)
    rank s sends its (block s, head group r) piece to rank r, for every r: a transpose of a P x P grid of pieces

Communication per attention call, per rank: 4 all-to-alls forward (q, k, v in, the output back) and 4 backward,
each of one rank's block B x nh x T/P x hs: at fixed global T, the payload per rank falls as 1/P.
The known limit: heads are not split, so P cannot exceed nh and must divide it (use ring attention, or Ulysses
within a group of at most nh ranks and ring attention across groups, for more ranks).
"""

from __future__ import annotations

import math

import torch

from parlab.core import comm


def seq_to_heads(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """All-to-all: [B, nh, T/P, hs] (my sequence block, all heads) -> [B, nh/P, T, hs] (all of it, my heads)."""
    P = comm.group_size(group)
    B, nh, Tp, hs = x.shape
    pieces = x.reshape(B, P, nh // P, Tp, hs).transpose(0, 1).contiguous()  # [P, B, nh/P, T/P, hs]: piece g for rank g
    out = torch.empty_like(pieces)
    comm.all_to_all_single(out, pieces, group=group, label=label)  # out[s] = rank s's piece for me: its block s
    return out.permute(1, 2, 0, 3, 4).reshape(B, nh // P, P * Tp, hs)  # blocks in sequence order: [B, nh/P, T, hs]


def heads_to_seq(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """All-to-all back: [B, nh/P, T, hs] (my heads, all of the sequence) -> [B, nh, T/P, hs]."""
    P = comm.group_size(group)
    B, nhp, T, hs = x.shape
    pieces = x.reshape(B, nhp, P, T // P, hs).permute(2, 0, 1, 3, 4).contiguous()  # [P, B, nh/P, T/P, hs]: block s
    out = torch.empty_like(pieces)
    comm.all_to_all_single(out, pieces, group=group, label=label)  # out[g] = rank g's heads of my block
    return out.transpose(0, 1).reshape(B, nhp * P, T // P, hs)  # head groups in order: [B, nh, T/P, hs]


class SeqToHeads(torch.autograd.Function):
    """seq_to_heads forward; its transpose, heads_to_seq, carries the gradient back."""

    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return seq_to_heads(x, group, f"{label} fwd")

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), ctx.group, f"{ctx.label} bwd"), None, None


class HeadsToSeq(torch.autograd.Function):
    """heads_to_seq forward; seq_to_heads carries the gradient back."""

    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return heads_to_seq(x, group, f"{label} fwd")

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), ctx.group, f"{ctx.label} bwd"), None, None


def attention(q, k, v, causal: bool) -> torch.Tensor:
    """Ordinary attention, written out as the reference GPT's (it saves the [B, nh/P, T, T] softmax for backward;
    a fused kernel such as F.scaled_dot_product_attention's flash path would not, and works here as well)."""
    T, hs = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # [B, nh/P, T, T]
    if causal:
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v


def check_heads(heads: int, world_size: int) -> None:
    if heads % world_size:
        raise ValueError(
            f"heads={heads} is not divisible by world_size={world_size}: DeepSpeed-Ulysses gives each rank nh/P whole "
            "heads, so it needs P to divide the number of heads (its known limit). Use a world size that divides "
            f"{heads}, or ring attention (which splits only the sequence), or Ulysses within groups of at most "
            f"{heads} ranks and ring attention across them."
        )


def ulysses_attention(q, k, v, causal: bool = True, group=None, label: str = "") -> torch.Tensor:
    """Attention of this rank's sequence block on the whole sequence, by two all-to-alls over `group`.

    q, k, v: this rank's sequence block [B, nh, T/P, hs] (tokens [r*T/P, (r+1)*T/P)); returns this rank's output
    block, same shape; differentiable.
    """
    check_heads(q.shape[1], comm.group_size(group))
    tag = f"{label} " if label else ""
    qh = SeqToHeads.apply(q, group, f"{tag}q")  # [B, nh/P, T, hs]
    kh = SeqToHeads.apply(k, group, f"{tag}k")
    vh = SeqToHeads.apply(v, group, f"{tag}v")
    with comm.span(f"attention {label}".strip(), "compute"):
        yh = attention(qh, kh, vh, causal)  # my heads, all T: [B, nh/P, T, hs]
    return HeadsToSeq.apply(yh, group, f"{tag}out")  # [B, nh, T/P, hs]


def a2a_bytes_per_call(batch: int, heads: int, seq: int, head_size: int, world_size: int, dtype_bytes: int) -> int:
    """Payload of one all-to-all per rank: its block [B, nh, T/P, hs]."""
    return batch * heads * (seq // world_size) * head_size * dtype_bytes
