"""USP, unified sequence parallelism (Fang & Zhao 2024): Ulysses inside, ring attention across, on a 2D mesh.

Ulysses (parlab/schemes/sequence/ulysses.py) cannot use more ranks than there are heads: it hands each rank nh/P whole
heads. Ring attention (parlab/schemes/sequence/ring_attention.py) scales to any P but sends K/V P-1 times per call. USP
puts the P ranks on a mesh of two axes, P = U x R:

    ulysses axis (U ranks, the fast links: neighbours)   an all-to-all trades the sequence split for a head split
    ring axis    (R ranks)                               ring attention over the R "ring blocks" of the sequence

             ulysses=0  ulysses=1                 rank = ring_index * U + ulysses_index
    ring=0    rank 0     rank 1       ulysses groups: {0, 1}, {2, 3}   (all-to-all inside each)
    ring=1    rank 2     rank 3       ring groups:    {0, 2}, {1, 3}   (K/V passed round each)

The sequence is cut first into R ring blocks (contiguous, or zigzag: chunks g and 2R-1-g of 2R, see
ring_attention.zigzag_split), then each ring block into U equal pieces: rank (g, u) holds piece u of ring
block g, q, k, v [B, nh, T/P, hs]. One attention call:

    1. all-to-all over the ulysses axis: [B, nh, T/P, hs] -> [B, nh/U, T/R, hs]  (ring block g, my head group u)
    2. ring attention over the ring axis on those heads: R-1 K/V sends of [2, B, nh/U, T/R, hs] forward
    3. all-to-all back: [B, nh/U, T/R, hs] -> [B, nh, T/P, hs]

Every head group is an independent attention, so step 2 is exactly ring attention on fewer heads, and the result
equals attention on the whole sequence. Only U must divide nh: with nh = 2 and P = 4, Ulysses alone is refused,
USP runs as U = 2, R = 2. U = 1 is ring attention; R = 1 is Ulysses.

Communication per attention call, per rank (D bytes per number; the backward mirrors the forward):
    ulysses axis: 4 all-to-alls forward (q, k, v, out) and 4 backward, each of [B, nh, T/P, hs]
    ring axis:    forward R-1 sends, backward R-1 K/V and R dK/dV sends, each of [2, B, nh/U, T/R, hs]
A ring block message is as big as one of a P-rank ring (2 B nh T hs D / P), but there are R-1 of them, not P-1.
"""

from __future__ import annotations

import torch

from parlab.core import comm
from parlab.core.models import GPT
from parlab.schemes.sequence.ring_attention import LAYOUTS, ring_attention, sequence_split, zigzag_merge
from parlab.schemes.sequence.sequence_parallel import SequenceShardedGPT
from parlab.schemes.sequence.ulysses import HeadsToSeq, SeqToHeads, check_heads
from parlab.schemes.tensor_parallel import train_tensor_parallel

AXES = ("ring", "ulysses")  # the mesh's axes, ulysses last: its ranks are neighbours (all-to-all on fast links)


def usp_mesh_axes(ulysses: int, ring: int) -> dict[str, int]:
    """The mesh shape for parlab.core.mesh.DeviceMesh: {"ring": R, "ulysses": U} (ulysses varies fastest)."""
    return {"ring": ring, "ulysses": ulysses}


def check_usp(heads: int, seq: int, ulysses: int, ring: int, world_size: int, layout: str = "contiguous") -> None:
    """Raise a ValueError (before any process starts) unless U x R = P, U divides the heads and the sequence
    cuts into R ring blocks (2R chunks for zigzag) of U equal pieces."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, n in (("ulysses", ulysses), ("ring", ring)):
        if n < 1:
            raise ValueError(f"{name}={n} must be >= 1")
    if ulysses * ring != world_size:
        raise ValueError(
            f"ulysses={ulysses} x ring={ring} = {ulysses * ring} ranks, but world_size={world_size}: "
            "USP puts every rank on a ulysses x ring mesh, so the two axes must multiply to the world size"
        )
    if heads % ulysses:
        raise ValueError(
            f"heads={heads} is not divisible by ulysses={ulysses}: the all-to-all gives each rank of a ulysses group "
            f"nh/U whole heads. Use a ulysses size that divides {heads} (and more ring ranks)."
        )
    if seq % world_size:
        raise ValueError(f"seq={seq} is not divisible by world_size={world_size}: each rank holds T/P tokens")
    if layout == "zigzag" and seq % (2 * ring):
        raise ValueError(
            f"seq={seq} is not divisible by 2 x ring = {2 * ring}: the zigzag layout cuts the sequence into 2R "
            "chunks (ring block g holds chunks g and 2R-1-g)"
        )


# ------------------------------------------------------------------------------------------------ the layout


def usp_split(
    x: torch.Tensor, ring_index: int, ulysses_index: int, ring: int, ulysses: int, dim: int, layout: str = "contiguous"
) -> torch.Tensor:
    """Rank (g, u)'s block of `x` along `dim`: piece u of U of ring block g (contiguous or zigzag over R)."""
    block = sequence_split(x, ring_index, ring, dim, layout)  # ring block g: T/R tokens
    if block.shape[dim] % ulysses:
        raise ValueError(f"a ring block of {block.shape[dim]} tokens does not cut into ulysses={ulysses} pieces")
    return block.chunk(ulysses, dim=dim)[ulysses_index]  # [.., T/P, ..]


def usp_merge(blocks: list[torch.Tensor], ring: int, ulysses: int, dim: int, layout: str = "contiguous"):
    """The inverse of usp_split: blocks[rank] (rank = g * U + u) -> the sequence in its original order."""
    ring_blocks = [torch.cat(blocks[g * ulysses : (g + 1) * ulysses], dim=dim) for g in range(ring)]
    return zigzag_merge(ring_blocks, dim) if layout == "zigzag" else torch.cat(ring_blocks, dim=dim)


# --------------------------------------------------------------------------------------------- the attention


def usp_attention(
    q, k, v, causal: bool = True, ulysses_group=None, ring_group=None, layout: str = "contiguous", label: str = ""
) -> torch.Tensor:
    """Attention of this rank's block on the whole sequence: all-to-all over `ulysses_group`, ring attention over
    `ring_group`, all-to-all back. Differentiable (the all-to-alls' backward is their transpose; the ring's is
    its own backward pass).

    q, k, v: rank (g, u)'s block [B, nh, T/P, hs] (see usp_split; g: index on the ring axis, u: on the ulysses
    axis). Returns this rank's output block, same shape.
    """
    U = comm.group_size(ulysses_group)
    check_heads(q.shape[1], U)
    tag = f"{label} " if label else ""
    qh = SeqToHeads.apply(q, ulysses_group, f"{tag}q")  # ring block g, head group u: [B, nh/U, T/R, hs]
    kh = SeqToHeads.apply(k, ulysses_group, f"{tag}k")
    vh = SeqToHeads.apply(v, ulysses_group, f"{tag}v")
    yh = ring_attention(qh, kh, vh, causal=causal, group=ring_group, layout=layout, label=label)  # [B, nh/U, T/R, hs]
    return HeadsToSeq.apply(yh, ulysses_group, f"{tag}out")  # my tokens, every head: [B, nh, T/P, hs]


# ---------------------------------------------------------------------------------------------------- the GPT


class USPGPT(SequenceShardedGPT):
    """The reference GPT on this rank's T/P tokens (weights replicated, as with Ulysses or ring attention alone),
    its attention by usp_attention over the mesh's two axes. forward(idx [B, T/P], positions [T/P]) -> [B, T/P, V].
    Each rank's weight gradients come from its own tokens: sync_grads sums them over all P ranks (group=None)."""

    def __init__(self, full: GPT, layout: str = "contiguous", ulysses_group=None, ring_group=None):
        super().__init__(full, "ring-zigzag" if layout == "zigzag" else "ring", group=None)
        self.ulysses_group, self.ring_group = ulysses_group, ring_group

    def attention(self, q, k, v, index: int):
        return usp_attention(
            q,
            k,
            v,
            causal=True,
            ulysses_group=self.ulysses_group,
            ring_group=self.ring_group,
            layout=self.layout,
            label=f"attn {index}",
        )


def train_usp(model: USPGPT, optimizer, batches, mesh) -> dict:
    """Rank code: train on global batches (x, y) [B, T]; this rank takes its USP block of the tokens (usp_split
    with its mesh coordinates) and its share of the mean loss; gradients summed over all ranks after backward."""
    g, u, R, U = mesh.index("ring"), mesh.index("ulysses"), mesh.size("ring"), mesh.size("ulysses")

    def loss_fn(model, x, y):
        positions = torch.arange(x.shape[1], device=x.device)
        idx, targets, pos = (usp_split(t, g, u, R, U, t.dim() - 1, model.layout) for t in (x, y, positions))
        return model.loss(idx, targets, pos, x.shape[1])

    return train_tensor_parallel(model, optimizer, batches, loss_fn=loss_fn, grad_sync=model.sync_grads)


# ------------------------------------------------------------------------------------------------- the theory


def usp_bytes_per_call(
    batch: int, heads: int, seq: int, head_size: int, ulysses: int, ring: int, dtype_bytes: int
) -> dict[str, int]:
    """Bytes one rank hands to torch.distributed per attention call (forward + backward), per axis.

    ulysses: 8 all-to-alls of its block [B, nh, T/P, hs]. ring: (R-1) + (R-1) K/V sends and R dK/dV sends of
    [2, B, nh/U, T/R, hs] (none when R = 1).
    """
    P = ulysses * ring
    a2a = batch * heads * (seq // P) * head_size * dtype_bytes
    block = 2 * batch * (heads // ulysses) * (seq // ring) * head_size * dtype_bytes
    sends = 0 if ring == 1 else (3 * ring - 2) * block
    return {
        "ulysses": 8 * a2a,  # at U = 1 the all-to-all is a local copy, still a call
        "ring": sends,
        "a2a_call": a2a,
        "ring_block": block,
        "kv fwd": (ring - 1) * block,
        "kv bwd": (ring - 1) * block,
        "dkv bwd": ring * block if ring > 1 else 0,
    }
