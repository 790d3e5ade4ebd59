"""Ring Attention (Liu, Zaharia, Abbeel 2023): attention over a sequence split across ranks, K/V passed round a ring.

The sequence of T tokens is split over P ranks. Rank r keeps its query block Q_r and, at ring step s = 0..P-1,
holds the key/value block of rank (r - s) mod P: it computes the attention of Q_r against that block, merges
the partial result into what it has so far, and passes the block on to rank r+1 (send/recv), so that after P
steps Q_r has seen every key exactly once and no rank ever held the whole sequence.

Merging partial results is the online softmax (Milakov & Gimelshein 2018, the rule of FlashAttention): a
partial result over a key block is its normalised output o and its log-sum-exp l = log sum_j exp(s_j) per query
row. Two of them combine exactly:

    l = log(exp(l_a) + exp(l_b))                          (logaddexp)
    o = exp(l_a - l) o_a + exp(l_b - l) o_b               (each rescaled by its share of the total weight)

Causal masking: query position i may see key positions j <= i. Work is counted in tiles, pieces of the T x T
score matrix: a tile entirely above the diagonal is skipped, a tile on it is masked, one below it is computed
whole. With the contiguous layout (rank r holds tokens [r*T/P, (r+1)*T/P)) rank r computes r+1 tiles of the
P x P grid: the last rank works P times as much as the first. The zigzag layout cuts the sequence into 2P chunks
and gives rank r chunks r and 2P-1-r (one early, one late): on the 2P x 2P grid every rank computes 2P+1 tiles.

Backward (it trains): each rank keeps Q_r, its output O_r and the final log-sum-exp L_r; the K/V blocks go
round the ring again, each travelling with an accumulator of its dK, dV; after P steps the accumulator of block
j has collected every rank's contribution and one last send delivers it to rank j.

Shapes: q, k, v: [B, nh, T/P, hs] on each rank, the layout of torch.nn.functional.scaled_dot_product_attention.
Communication per attention call, per rank: forward P-1 sends of one K/V block [2, B, nh, T/P, hs]; backward
P-1 K/V sends and P dK/dV sends. Every tile a rank computes is a comm.span with its ring step and its query
and key chunk, so lesson 04 draws the score matrix filling up from the trace.
"""

from __future__ import annotations

import math

import torch

from parlab.core import comm

LAYOUTS = ("contiguous", "zigzag")

# ------------------------------------------------------------------------------------------------ the layout


def chunks_of(rank: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """The sequence chunks rank `rank` holds, in order. contiguous: chunk r of P; zigzag: chunks r and 2P-1-r of 2P."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks_per_rank(layout: str) -> int:
    return len(chunks_of(0, 1, layout))


def zigzag_split(x: torch.Tensor, rank: int, world_size: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s zigzag block of `x`: chunks r and 2P-1-r of the 2P chunks along `dim`, concatenated."""
    if x.shape[dim] % (2 * world_size):
        raise ValueError(
            f"sequence length {x.shape[dim]} is not divisible by 2 x world_size = {2 * world_size} "
            "(zigzag cuts the sequence into 2P chunks)"
        )
    pieces = x.chunk(2 * world_size, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, world_size, "zigzag")], dim=dim)


def zigzag_merge(blocks: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of zigzag_split: blocks[r] is rank r's block; returns the sequence in its original order."""
    P = len(blocks)
    pieces: list[torch.Tensor | None] = [None] * (2 * P)
    for r, block in enumerate(blocks):
        for c, piece in zip(chunks_of(r, P, "zigzag"), block.chunk(2, dim=dim), strict=True):
            pieces[c] = piece
    return torch.cat(pieces, dim=dim)


def sequence_split(x: torch.Tensor, rank: int, world_size: int, dim: int, layout: str = "contiguous") -> torch.Tensor:
    """Rank `rank`'s block of the sequence along `dim` in either layout."""
    if layout == "zigzag":
        return zigzag_split(x, rank, world_size, dim)
    if x.shape[dim] % world_size:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by world_size={world_size}")
    return x.chunk(world_size, dim=dim)[rank]


def tile_mask(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """What a causal mask leaves of the tile (q_chunk, k_chunk) of the score matrix: "full", "diagonal" or "skip"."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "skip"


def tiles_theory(world_size: int, layout: str, causal: bool = True) -> list[int]:
    """Tiles each rank computes in one attention call (the count the trace is checked against)."""
    P = world_size
    return [
        sum(
            tile_mask(qc, kc, causal) != "skip"
            for qc in chunks_of(r, P, layout)
            for j in range(P)
            for kc in chunks_of(j, P, layout)
        )
        for r in range(P)
    ]


# ----------------------------------------------------------------------------------------- the online softmax


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two partial attention results over disjoint key sets into the result over their union.

    out: [..., Tq, hs], normalised over its own keys; lse: [..., Tq], log sum exp of its scores.
    Each output is rescaled by its share exp(lse - lse_new) of the total softmax weight.
    """
    lse = torch.logaddexp(lse_a, lse_b)  # [..., Tq]
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


def tile_scores(q: torch.Tensor, k: torch.Tensor, mask: str) -> torch.Tensor:
    """Scaled scores of one tile, q [B, nh, c, hs] x k [B, nh, c, hs] -> [B, nh, c, c], causally masked on the
    diagonal (the query and key chunks start at the same position there)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask == "diagonal":
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def attend_tile(q, k, v, mask: str):
    """Attention of a query chunk on one key/value chunk: (out [B, nh, c, hs] normalised, lse [B, nh, c])."""
    scores = tile_scores(q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


# --------------------------------------------------------------------------------------- ring communication


def _ring_peers(group):
    rank, P = comm.group_rank(group), comm.group_size(group)
    return comm.global_rank(group, (rank + 1) % P), comm.global_rank(group, (rank - 1) % P)


def _pass_on(block: torch.Tensor, group, label: str):
    """Start sending `block` to the next rank and receiving the previous rank's into a new buffer."""
    nxt, prev = _ring_peers(group)
    incoming = torch.empty_like(block)
    works = [comm.irecv(incoming, prev, group=group, label=label), comm.isend(block, nxt, group=group, label=label)]
    return incoming, works


# ----------------------------------------------------------------------------------------------- ring attention


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, group, layout: str, label: str):
        rank, P = comm.group_rank(group), comm.group_size(group)
        n = chunks_per_rank(layout)
        q_chunks = chunks_of(rank, P, layout)
        qs = q.chunk(n, dim=-2)  # my query chunks: n x [B, nh, c, hs]
        outs: list[torch.Tensor | None] = [None] * n
        lses: list[torch.Tensor | None] = [None] * n
        kv = torch.stack([k, v]).contiguous()  # the block that travels: [2, B, nh, T/P, hs]
        for step in range(P):
            src = (rank - step) % P  # whose K/V I hold at this step
            if step < P - 1:  # pass it on while I compute with it
                incoming, works = _pass_on(kv, group, f"kv fwd {label}".strip())
            ks, vs = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
            for i, qc in enumerate(q_chunks):
                for j, kc in enumerate(chunks_of(src, P, layout)):
                    mask = tile_mask(qc, kc, causal)
                    if mask == "skip":
                        continue
                    with comm.span(f"tile q{qc} k{kc}", "compute", attn="fwd", ring_step=step, q=qc, k=kc, tag=label):
                        o, lse = attend_tile(qs[i], ks[j], vs[j], mask)
                        if outs[i] is None:
                            outs[i], lses[i] = o, lse
                        else:
                            outs[i], lses[i] = merge_partials(outs[i], lses[i], o, lse)
            if step < P - 1:
                comm.wait_all(works)
                kv = incoming
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)  # [B, nh, T/P, hs], [B, nh, T/P]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.layout, ctx.label = causal, group, layout, label
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, group, layout, label = ctx.causal, ctx.group, ctx.layout, ctx.label
        rank, P = comm.group_rank(group), comm.group_size(group)
        n, scale = chunks_per_rank(layout), 1.0 / math.sqrt(q.shape[-1])
        q_chunks = chunks_of(rank, P, layout)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # D_i = sum_d dO_id O_id: [B, nh, T/P]
        qs, dos = q.chunk(n, dim=-2), dout.chunk(n, dim=-2)
        lses, deltas = lse.chunk(n, dim=-1), delta.chunk(n, dim=-1)
        dq = torch.zeros_like(q)
        dqs = dq.chunk(n, dim=-2)  # views: accumulating into them fills dq
        kv = torch.stack([k, v]).contiguous()  # [2, B, nh, T/P, hs]
        dkv = torch.zeros_like(kv)  # the accumulator of dK, dV that travels with the K/V block
        for step in range(P):
            src = (rank - step) % P
            if step < P - 1:
                incoming, works = _pass_on(kv, group, f"kv bwd {label}".strip())
            ks, vs = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
            dks, dvs = dkv[0].chunk(n, dim=-2), dkv[1].chunk(n, dim=-2)
            for i, qc in enumerate(q_chunks):
                for j, kc in enumerate(chunks_of(src, P, layout)):
                    mask = tile_mask(qc, kc, causal)
                    if mask == "skip":
                        continue
                    with comm.span(f"tile q{qc} k{kc}", "compute", attn="bwd", ring_step=step, q=qc, k=kc, tag=label):
                        p = torch.exp(tile_scores(qs[i], ks[j], mask) - lses[i].unsqueeze(-1))  # softmax: [B, nh, c, c]
                        dvs[j].add_(p.transpose(-2, -1) @ dos[i])  # dV_j += P^T dO
                        ds = p * (dos[i] @ vs[j].transpose(-2, -1) - deltas[i].unsqueeze(-1))  # dS = P (dP - D)
                        dqs[i].add_(ds @ ks[j] * scale)  # dQ_i += dS K_j / sqrt(hs)
                        dks[j].add_(ds.transpose(-2, -1) @ qs[i] * scale)  # dK_j += dS^T Q_i / sqrt(hs)
            # the accumulator follows its K/V block to the next rank; after the last step it reaches the block's owner
            dkv, dworks = _pass_on(dkv, group, f"dkv bwd {label}".strip()) if P > 1 else (dkv, [])
            comm.wait_all(dworks)
            if step < P - 1:
                comm.wait_all(works)
                kv = incoming
        return dq, dkv[0], dkv[1], None, None, None, None


def check_inputs(q, k, v, world_size: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(f"q, k, v must all be [B, nh, T/P, hs]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"zigzag: each rank's block ({q.shape[-2]} tokens) must hold two equal chunks")


def ring_attention(q, k, v, causal: bool = True, group=None, layout: str = "contiguous", label: str = ""):
    """Attention of this rank's query block on the whole sequence, K/V blocks passed round the ring of `group`.

    q, k, v: this rank's sequence block [B, nh, T/P, hs] (contiguous: tokens [r*T/P, (r+1)*T/P); zigzag: chunks
    r and 2P-1-r of 2P, see zigzag_split). Returns this rank's output block, same shape; differentiable.
    """
    check_inputs(q, k, v, comm.group_size(group), layout)
    return RingAttention.apply(q, k, v, causal, group, layout, label)


def kv_block_bytes(batch: int, heads: int, seq: int, head_size: int, world_size: int, dtype_bytes: int) -> int:
    """Bytes of one K/V block a rank sends per ring step: [2, B, nh, T/P, hs]."""
    return 2 * batch * heads * (seq // world_size) * head_size * dtype_bytes
