"""Experts (ep) and USP in the hybrid mesh (parlab/schemes/hybrid/train.py): the two axes that split another axis'
ranks.

ep: a GPT with MoE layers (parlab/core/moe.py). MoE layers are token-wise: an expert does not care which row or which
slice of the sequence a token came from, so every rank of the dp x cp group (different tokens, the same weights)
can serve as an expert rank. The ep axis therefore borrows its ranks from dp x cp flattened (as torchtitan borrows
EP from dp_shard x cp, and Megatron from its data-parallel ranks): ep divides D x C, and the N = D C ranks of a
"dp_cp" group split into N / ep "ep" groups of ep consecutive ranks (ep fastest) and ep "edp" groups (expert data
parallel) of the ranks at the same place in their ep group:

    dp_cp index n = dp C + cp       ep rank = n mod ep (holds experts [r E/ep, (r+1) E/ep))    edp rank = n // ep

    what                      held by                                  gradients averaged over (then / N)
    attention, norms, router  every rank of dp x cp (its tp slices)    dp_cp: all N ranks
    expert e's MLP            the edp group of ep rank e // (E/ep)      edp: the N / ep ranks holding it (the ep
                                                                       group's tokens are already summed in by the
                                                                       all-to-all's backward)

Inside a stage the MoE layer is ExpertParallelMoE (parlab/schemes/expert_parallel.py) on the ep group: this rank routes
its tokens of a micro-batch [b, T/cp] as one capacity group, dispatches them by all-to-all, runs its E/ep experts and
combines. The single-device reference routes the same groups: GShard groups over rows (one per replica and
micro-batch, MoEConfig(groups=D m)) and over the sequence (one per cp block, MoEConfig(seq_groups=...)), so every
capacity drop and every aux loss is the same number. The aux loss of a layer on any pipeline stage joins the loss
through the layer's output (Megatron's MoEAuxLossAutoScaler): the forward passes the output on unchanged, the
backward hands the aux loss the gradient aux_weight / m (the pipeline's 1/m per micro-batch).

With tp the experts are replicated over the tp group (not split): after attention's g every tp rank holds the same
tokens [b, T/cp, H], routes them the same way and runs the same experts, so no tp collective is needed in an MoE
block. Refused: Megatron SP with MoE (SP gives each tp rank other tokens: the replicated experts' gradients and
the capacity groups would split over tp), and ZeRO with MoE (ZeRO shards one flat buffer per layer over dp x cp,
but an expert is held by dp x cp / ep ranks only, and an expert without tokens leaves its layer's gradients
incomplete, which ZeRO 2-3 wait for).

USP (parlab/schemes/sequence/usp.py) as the cp method: the C ranks of a cp group split into ring x ulysses sub-axes,
ulysses fastest (cp rank c = g U + u; contiguous ring blocks, so rank c holds exactly the contiguous cp block c of the
sequence): an all-to-all over "ulysses" (U ranks) trades T/C tokens of nh/tp heads for T/R tokens of nh/(tp U) heads,
ring attention runs over "ring" (R = C / U ranks), an all-to-all brings the output back.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
import torch.nn as nn

from parlab.core import comm
from parlab.core.moe import MoE, check_moe
from parlab.schemes.expert_parallel import ExpertParallelMoE, all_to_all_payload, is_expert_param
from parlab.schemes.sequence.ring_attention import sequence_split

# --------------------------------------------------------------------------------------------- the sub-axes


def expert_groups(mesh, ep: int) -> tuple[object, object]:
    """This rank's (edp, ep) groups on a parlab.core.mesh.DeviceMesh: dp x cp flattened, cut into ep groups of ep
    consecutive ranks (the experts' all-to-all) and edp groups of the ranks holding the same experts (their
    gradients' all-reduce). Collective."""
    return mesh.unflatten(("dp", "cp"), ep, ("edp", "ep"))


# ------------------------------------------------------------------------------------------- the MoE layer


class AttachAux(torch.autograd.Function):
    """y = x in the forward; in the backward the aux loss receives the gradient `scale` (Megatron's
    MoEAuxLossAutoScaler): the loss of a layer on any pipeline stage joins the training loss with no extra
    message, because the backward of the layer's output reaches it. x: [b, T/cp, H]; aux: a scalar."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def hybrid_moe(full: MoE, ep_group, label: str) -> MoE:
    """This rank's copy of an MoE layer: its E/ep experts on the ep group (all of them when ep = 1), routing
    this rank's tokens of a micro-batch [b, T/cp, H] as one capacity group."""
    layer = copy.deepcopy(full)
    if ep_group is not None:
        layer = ExpertParallelMoE(layer, ep_group, label=label)
    layer.cfg = replace(layer.cfg, groups=1, seq_groups=())
    layer.aux_scale, layer.aux_seen = 0.0, []  # aux_weight / m, set by the training loop; each forward's aux
    return layer


def moe_forward(layer: MoE, h: torch.Tensor) -> torch.Tensor:
    """The MoE layer on h [b, T/cp, H] -> [b, T/cp, H], its aux loss attached (and recorded for the report)."""
    y = layer(h)
    ep = getattr(layer, "stats_ep", None)  # ExpertParallelMoE: this call's split sizes
    rows = (sum(ep["send_splits"]), sum(ep["recv_splits"])) if ep else None
    layer.aux_seen.append((layer.aux_loss.item(), layer.stats["dropped"], layer.stats["load"], rows))
    return AttachAux.apply(y, layer.aux_loss, layer.aux_scale)


def moe_modules(modules: nn.Module) -> list[MoE]:
    return [m for m in modules.modules() if isinstance(m, MoE)]


def drain_moe_stats(layers: list[MoE]) -> dict:
    """What this rank's MoE layers saw in one step (and forget it): the sum of their aux losses over layers and
    micro-batches, the dropped assignments, and each call's (rows sent, rows received) of the ep all-to-all."""
    seen = [call for m in layers for call in m.aux_seen]
    for m in layers:
        m.aux_seen.clear()
    E = layers[0].cfg.experts if layers else 0
    return {
        "aux": sum(aux for aux, _, _, _ in seen),  # unweighted, summed over layers and micro-batches
        "dropped": sum(dropped for _, dropped, _, _ in seen),
        "load": [sum(load[e] for _, _, load, _ in seen) for e in range(E)],  # assignments routed to each expert
        "a2a_rows": [rows for _, _, _, rows in seen if rows is not None],  # [(S, R)] per ep call
    }


def sync_expert_gradients(modules: nn.Module, group, expert_group, N: int) -> None:
    """Average the gradients over the N = D C ranks of dp x cp: dense ones all-reduced over `group` (dp_cp),
    expert ones over `expert_group` (edp: the ranks holding the same experts; None: one rank), each then / N.
    One blocking call per tensor, as all_reduce_gradients; a parameter with no gradient (an expert that got no
    token) counts as zero."""
    for name, p in modules.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        on = expert_group if is_expert_param(name) else group
        if on is not None:
            comm.all_reduce(p.grad, group=on, label=name)  # p.grad <- sum over the group's ranks (in place)
        p.grad.div_(N)


# ------------------------------------------------------------------------------------------------ the checks


def reference_seq_groups(seq_len: int, cp: int, layout: str) -> tuple[tuple[int, ...], ...]:
    """The positions each cp rank holds (MoEConfig.seq_groups of the single-device reference); () if cp = 1."""
    if cp == 1:
        return ()
    positions = torch.arange(seq_len)  # host: plain numbers for the reference's config
    return tuple(tuple(sequence_split(positions, c, cp, 0, layout).tolist()) for c in range(cp))


def check_experts(cfg, sizes: dict[str, int], *, zero: int, sequence_parallel: bool) -> None:
    """The ep axis and MoE: refuse what cannot run, and say why (called by check_parallel_dims)."""
    ep, N = sizes["ep"], sizes["dp"] * sizes["cp"]
    if ep > 1 and cfg.moe is None:
        raise ValueError(f"ep={ep} spreads the experts of MoE layers, but the model has none (add --experts E)")
    if N % ep:
        raise ValueError(
            f"the ep axis (ep={ep}) borrows its ranks from dp x cp = {sizes['dp']} x {sizes['cp']} = {N}: "
            "ep must divide it"
        )
    if cfg.moe is None:
        return
    check_moe(cfg.moe.experts, cfg.moe.top_k, cfg.moe.capacity_factor, ep)
    if sequence_parallel:
        raise ValueError(
            "sequence_parallel with MoE layers: SP gives each tp rank other tokens, so the experts replicated over "
            "tp would see partial batches and the capacity groups would split over tp (run MoE with tp, no SP)"
        )
    if zero:
        raise ValueError(
            f"zero={zero} with MoE layers: ZeRO shards one flat buffer per layer over all dp x cp ranks, but an "
            f"expert lives on dp x cp / ep = {N // ep} of them, and an expert without tokens leaves its layer's "
            "gradients incomplete (use zero 0)"
        )


def check_usp_axis(cfg, sizes: dict[str, int], ulysses: int, cp_method: str) -> None:
    """USP over the cp axis: ulysses U divides cp, and U divides each tp rank's heads (called by
    check_parallel_dims, after the sequence's split into cp blocks is checked)."""
    C, nh = sizes["cp"], cfg.heads // sizes["tp"]
    if cp_method != "usp":
        if ulysses > 1:
            raise ValueError(f"ulysses={ulysses} splits the cp axis for cp_method usp, not {cp_method!r}")
        return
    if ulysses < 1 or C % ulysses:
        raise ValueError(f"the cp axis (USP, cp={C}): ulysses={ulysses} must divide cp (ring = cp / ulysses)")
    if nh % ulysses:
        raise ValueError(
            f"the cp axis (USP, cp={C} = ulysses {ulysses} x ring {C // ulysses}): heads / tp = {nh} is not "
            f"divisible by ulysses={ulysses}: each rank of a ulysses group needs whole heads (use a smaller --ulysses)"
        )


# ------------------------------------------------------------------------------------------------ the theory


def block_numels(cfg, layer: int, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) numbers one rank holds of block `layer`: TP-split matrices / tp; an MoE block's router
    [E, H] replicated and its E/ep experts (2 F H + F + H each), replicated over tp."""
    H, F = cfg.hidden, cfg.ffn
    attention = (4 * H * H + 3 * H) // tp + 5 * H  # q k v (+ biases), proj split; ln1, ln2, proj bias whole
    if cfg.moe is None or not cfg.moe.is_moe_layer(layer):
        return attention + (2 * F * H + F) // tp + H, 0  # fc (+ bias), proj split; proj bias whole
    return attention + cfg.moe.experts * H, cfg.moe.experts // ep * (2 * F * H + F + H)


def is_moe_block(cfg, layer: int) -> bool:
    return cfg.moe is not None and cfg.moe.is_moe_layer(layer)


def ep_all_to_all_bytes(calls: list[tuple[int, int]], cfg) -> int:
    """Bytes a rank hands to all_to_all_single on the ep axis for its MoE calls [(rows sent S, received R)]:
    per call the counts [E] (8 bytes each) and S + R rows of H forward, the same rows again backward."""
    return sum(all_to_all_payload(S, R, cfg.hidden, cfg.dtype_bytes, cfg.moe.experts) for S, R in calls)


def usp_sizes(cp: int, ulysses: int) -> tuple[int, int]:
    """(ulysses U, ring R) of the cp axis; ring alone (U = 1) or Ulysses alone (R = 1) are its corners."""
    return ulysses, cp // ulysses


def default_ulysses(cp: int, heads_per_tp: int) -> int:
    """The largest ulysses size the heads allow: gcd(cp, nh/tp) (the rest of cp goes round the ring)."""
    return math.gcd(cp, max(heads_per_tp, 1))
