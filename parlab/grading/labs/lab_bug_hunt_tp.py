"""The bug hunt, part 2: tensor parallelism of the lab model's block, its K/V heads shared by pairs of ranks.

The block (parlab.core.lab_model.LabBlock: RMSNorm, grouped-query attention with RoPE, RMSNorm, SwiGLU, two
residuals) over P ranks, Megatron-style (Shoeybi et al. 2019): rank r holds query heads [r nq/P, (r+1) nq/P) (the
rows of q, the columns of o) and the SwiGLU units [r k, (r+1) k), k = F/P (rows of gate and up, columns of down);
the RMSNorm gains are replicated. With fewer K/V heads than ranks, each K/V head (its rows of k and v) is
replicated on the ranks whose query heads read it, and its gradient is summed over them after backward. The
student's code is the block's forward on one rank (`tp_block`, with Megatron's f and g), the ranks that share each
K/V head (`kv_groups`) and the gradient sync after backward (`sync_grads`); this file trains it TP_STEPS SGD steps
on the mean squared error of the block's output, as one device trains the whole block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.core.lab_model import LabBlock, gqa_attention
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab_bug_hunt_setup import (
    BATCH,
    LAUNCH,
    LIBRARY,
    T_TP,
    TP_CFG,
    TP_LR,
    TP_STEPS,
    P,
    _randn,
    bytes_line,
    curve_line,
    library_verdict,
)

# The block's weights by the names tp_block reads (LabBlock's parameter names beside them).
NAMES = {
    "attn_norm": "attn_norm.weight",
    "q": "attn.q.weight",
    "k": "attn.k.weight",
    "v": "attn.v.weight",
    "o": "attn.o.weight",
    "mlp_norm": "mlp_norm.weight",
    "gate": "mlp.gate.weight",
    "up": "mlp.up.weight",
    "down": "mlp.down.weight",
}


def tp_weights() -> dict[str, torch.Tensor]:
    """The whole block's weights, by tp_block's names: block 0 of a small lab model, its matrices scaled up from their
    initial N(0, 0.02^2) and its gains moved off 1, as a trained model's are."""
    from parlab.core.lab_model import build_lab_model

    block = build_lab_model(TP_CFG, seed=20).blocks[0]  # host: the weights, scaled and moved below
    full = {name: block.get_parameter(NAMES[name]).detach().to(parlab.device()) * 10 for name in NAMES}
    full["attn_norm"] = 1 + _randn(TP_CFG.hidden, seed=22) / 4
    full["mlp_norm"] = 1 + _randn(TP_CFG.hidden, seed=23) / 4
    return full


def tp_slices(full: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """Rank r's weights: its query heads' rows of q and columns of o, the rows of k and v its query heads read (the
    lab model's pairing: gqa_attention's), its SwiGLU units' rows of gate and up and columns of down; the gains."""
    hd, nq, nkv, H = TP_CFG.head_size, TP_CFG.heads, TP_CFG.kv_heads, TP_CFG.hidden
    heads = slice(r * nq // P * hd, (r + 1) * nq // P * hd)  # this rank's query heads, hd rows each
    units = slice(r * TP_CFG.ffn // P, (r + 1) * TP_CFG.ffn // P)

    def read_by_my_heads(w: torch.Tensor) -> torch.Tensor:  # [nkv hd, H] -> [hd, H]
        per_query_head = gqa_pairing(w.view(1, nkv, hd, H), nq)[0]  # [nq, hd, H]: the K/V rows each query head reads
        return per_query_head[r * nq // P].clone()

    return {
        "attn_norm": full["attn_norm"].clone(),  # [H], replicated
        "q": full["q"][heads].clone(),  # [nq/P hd, H]
        "k": read_by_my_heads(full["k"]),  # [hd, H]: replicated on the ranks reading this head
        "v": read_by_my_heads(full["v"]),  # [hd, H]
        "o": full["o"][:, heads].clone(),  # [H, nq/P hd]
        "mlp_norm": full["mlp_norm"].clone(),  # [H], replicated
        "gate": full["gate"][units].clone(),  # [F/P, H]
        "up": full["up"][units].clone(),  # [F/P, H]
        "down": full["down"][:, units].clone(),  # [H, F/P]
    }


def gqa_pairing(kv: torch.Tensor, nq: int) -> torch.Tensor:
    """The K/V entries each of nq query heads reads in the lab model's attention: gqa_attention run on heads that
    pick them out (q one-hot, no softmax spread: one key per query), so that the pairing has one home, the model.
    kv: [B, nkv, n, d] -> [B, nq, n, d]."""
    B, nkv, n, d = kv.shape
    eye = torch.eye(n, dtype=kv.dtype, device=kv.device)
    q = eye.expand(B, nq, n, n) * 1e4  # query i sees key i with a score that leaves the others no weight
    keys = eye.expand(B, nkv, n, n)
    return gqa_attention(q, keys, kv.contiguous(), causal=False)


def tp_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s input x and the output it should give: [BATCH, T_TP, H] each, the same on every rank."""
    H = TP_CFG.hidden
    return _randn(BATCH, T_TP, H, seed=21 + 2 * step), _randn(BATCH, T_TP, H, seed=22 + 2 * step)


def tp_sgd(weights: dict[str, torch.Tensor]) -> None:
    """w <- w - TP_LR dL/dw on every tensor, the gradients dropped."""
    with torch.no_grad():
        for w in weights.values():
            w -= TP_LR * w.grad
            w.grad = None


def run_tp(tp_block, kv_groups, sync_grads) -> dict:
    """Rank code: the process groups of `kv_groups` made (every rank makes each, in order); then TP_STEPS steps of
    training rank r's weights: `tp_block` (your code) forward, the mean squared error against the step's target
    (the same on every rank), backward, `sync_grads` (your code) with the group this rank is in, SGD. Returns each
    step's loss, the bytes communicated in forward, backward and sync_grads, and the weights after the last step."""
    r = dist.get_rank()
    members = kv_groups(P, TP_CFG.heads, TP_CFG.kv_heads)
    groups = [dist.new_group([int(i) for i in ranks]) for ranks in members]  # every rank, the same order
    mine = [g for ranks, g in zip(members, groups, strict=True) if r in ranks]
    if len(mine) != 1:
        raise ValueError(f"kv_groups put rank {r} in {len(mine)} groups: {members}")
    w = tp_slices(tp_weights(), r)
    for t in w.values():
        t.requires_grad_()
    positions = torch.arange(T_TP, device=parlab.device())
    losses, traffic, called = [], [], []
    for step in range(TP_STEPS):
        x, target = tp_data(step)
        x.requires_grad_()  # the block's input comes from the layers below: its gradient is wanted too
        with library_calls(LIBRARY) as seen:
            with probe.recording(keep_sent_data=False) as forward_calls:
                y = tp_block(x, w, positions)
            loss = ((y - target) ** 2).mean()  # every rank alike: y is replicated
            with probe.recording(keep_sent_data=False) as backward_calls:
                loss.backward()
            with probe.recording(keep_sent_data=False) as sync_calls:
                sync_grads(w, mine[0])
        tp_sgd(w)
        losses.append(loss.item())
        traffic.append(
            [sum(int(c["bytes"]) or 1 for c in calls) for calls in (forward_calls, backward_calls, sync_calls)]
        )
        called += seen
    return {"losses": losses, "weights": {n: t.detach() for n, t in w.items()}, "traffic": traffic, "library": called}


def tp_single_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device: the lab model's own block with the whole weights, the same steps. Each step's loss, and the
    weights after the last."""
    block = LabBlock(TP_CFG).to(torch.float64).to(parlab.device())
    block.load_state_dict({NAMES[n]: t for n, t in tp_weights().items()})
    positions = torch.arange(T_TP, device=parlab.device())
    losses = []
    for step in range(TP_STEPS):
        x, target = tp_data(step)
        loss = ((block(x, positions) - target) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in block.parameters():
                p -= TP_LR * p.grad
                p.grad = None
    return losses, {n: block.get_parameter(NAMES[n]).detach() for n in NAMES}


def collect_tp_training(tp_block, kv_groups, sync_grads) -> dict:
    return {"ranks": list(parlab.launch(run_tp, P, tp_block, kv_groups, sync_grads, **LAUNCH))}


def judge_tp_training(data) -> list[str]:
    ranks = data["ranks"]
    losses, final = tp_single_device()
    H, hd = TP_CFG.hidden, TP_CFG.head_size
    lines = [
        curve_line(f"the loss of each of {TP_STEPS} steps (rank 0)", ranks[0]["losses"], losses),
        compare(
            f"every rank's weights after {TP_STEPS} steps",
            [res["weights"] for res in ranks],
            [tp_slices(final, r) for r in range(P)],
        ).line,
    ]
    one = BATCH * T_TP * H * 8  # one [B, T, H]
    for i, (phase, most, what) in enumerate(
        [
            ("forward", 2 * one, "one [B, T, H] per sublayer"),
            ("backward", 2 * one, "one [B, T, H] per sublayer"),
            ("sync_grads", 2 * hd * H * 8, "the rows of k and v of one K/V head"),
        ]
    ):
        per_step = [[step[i] for step in res["traffic"]] for res in ranks]
        what = f"bytes each rank communicates in {phase}, in every step ({what})"
        lines.append(bytes_line(what, per_step, most, most))
    lines.append(library_verdict("tp_block, kv_groups, sync_grads", [c for res in ranks for c in res["library"]]))
    return lines
