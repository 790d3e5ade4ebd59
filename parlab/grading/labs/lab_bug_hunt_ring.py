"""The bug hunt, part 6: a ring-attention forward for grouped K/V heads, under the library's backward.

Rank r holds tokens [r c, (r+1) c) of q [B, nq, c, hd] and of k, v [B, nkv, c, hd] (contiguous layout, causal). The
student's forward passes the K/V block round the ring (`pass_on`, K/V heads only) and returns (out, lse); the
backward is the library's (`RingAttention.backward`, parlab/schemes/sequence/ring_attention.py), run on the
(q, k, v, out, lse) that forward returned, with each K/V head repeated for its query heads (the library's backward
knows no grouped heads); the K/V gradients of a group's query heads are then summed back into their K/V head.
While the forward runs, every tensor it makes is watched (a TorchFunctionMode): none may hold a K/V block copied for
each query head of its group, the cost grouped-query attention exists to avoid (bytes sent are not the only place
it shows: a copy made after receiving a block costs the same memory and memory traffic).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import parlab
from parlab.core import comm, probe
from parlab.core.check import compare
from parlab.core.lab_model import gqa_attention
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab_bug_hunt_setup import (
    HD,
    LAUNCH,
    LIBRARY,
    RING_C,
    RING_HEADS,
    P,
    _no_error,
    attention_problem,
    library_verdict,
)
from parlab.schemes.sequence.ring_attention import RingAttention


def pass_on(block: torch.Tensor):
    """Start sending `block` to rank r+1 and receiving rank r-1's block into a new buffer: (incoming, works);
    comm.wait_all(works) before reading `incoming` (or reusing `block`)."""
    r = comm.group_rank()
    incoming = torch.empty_like(block)
    works = [comm.irecv(incoming, (r - 1) % P), comm.isend(block, (r + 1) % P)]
    return incoming, works


class KVCopies(TorchFunctionMode):
    """Counts the tensors made while it is on (the results of every torch function and tensor method called) that
    hold one of `blocks` entry for entry, in any order: the K/V blocks [B, nkv, c, hd] copied once per query head,
    [B, nq, c, hd], alone or K and V stacked."""

    def __init__(self, blocks: list[torch.Tensor]):
        super().__init__()
        self.sorted: dict[int, list[torch.Tensor]] = {}
        for b in blocks:
            self.sorted.setdefault(b.numel(), []).append(b.reshape(-1).sort().values)
        self.found = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() in self.sorted:
                values = t.detach().reshape(-1).sort().values
                self.found += any(torch.equal(values, b) for b in self.sorted[t.numel()])
        return out


def copied_blocks(k: torch.Tensor, v: torch.Tensor, group: int) -> list[torch.Tensor]:
    """Every rank's K/V block of the whole sequence's k, v [B, nkv, P c, hd], each K/V head repeated for the `group`
    query heads that read it: K, V and the two stacked, for each of the P blocks."""
    out = []
    for k_j, v_j in zip(k.chunk(P, dim=-2), v.chunk(P, dim=-2), strict=True):
        k_rep, v_rep = k_j.repeat_interleave(group, dim=1), v_j.repeat_interleave(group, dim=1)  # [B, nq, c, hd]
        out += [k_rep, v_rep, torch.stack([k_rep, v_rep])]
    return out


class _RingWithYourForward(torch.autograd.Function):
    """The library's ring attention, causal, contiguous layout, with your forward in place of its own: its backward
    gets the (q, k, v, out, lse) your forward returns, each K/V head repeated for its query heads, and the K/V
    gradients of a group's query heads are summed back into their K/V head."""

    @staticmethod
    def forward(ctx, q, k, v, ring_forward, watch):
        with watch:
            out, lse = ring_forward(q, k, v)
        group = q.shape[1] // k.shape[1]
        k_all, v_all = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, nq, c, hd]
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.causal, ctx.group, ctx.layout, ctx.label, ctx.kv_group = True, None, "contiguous", "", group
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = RingAttention.backward(ctx, dout)[:3]  # the library's: each tile's softmax from lse
        dk, dv = (t.unflatten(1, (-1, ctx.kv_group)).sum(2) for t in (dk, dv))  # [B, nkv, c, hd]
        return dq, dk, dv, None, None


def run_ring(ring_forward) -> dict:
    """Rank code: for each (nq, nkv) of RING_HEADS, rank r holds tokens [r c, (r+1) c) of q, k, v, runs your forward
    (the bytes it sends recorded, and the tensors it makes watched) and the library's backward from sum(out_r G_r)."""
    r, c = dist.get_rank(), RING_C
    out = {}
    for heads, kv_heads in RING_HEADS:
        whole = attention_problem(heads, kv_heads, P * c, seed=60 + heads)  # [1, n, P c, HD]: the whole sequence
        q, k, v, g = (t[..., r * c : (r + 1) * c, :].clone() for t in whole)
        for t in (q, k, v):
            t.requires_grad_()
        group = heads // kv_heads
        watch = KVCopies(copied_blocks(whole[1], whole[2], group) if group > 1 else [])
        with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as called:
            o = _RingWithYourForward.apply(q, k, v, ring_forward, watch)  # [1, nq, c, HD]
        (o * g).sum().backward()
        sent = sum(int(c["bytes"]) for c in calls if c["op"] == "send")
        out[(heads, kv_heads)] = {
            "out": o.detach(),
            "dq": q.grad,
            "dk": k.grad,
            "dv": v.grad,
            "sent": sent,
            "copies": watch.found,
            "library": called,
        }
    return out


def collect_ring_gqa(ring_forward) -> dict:
    return {
        "ranks": [
            {str(key): value for key, value in res.items()}
            for res in parlab.launch(run_ring, P, ring_forward, **LAUNCH)
        ]
    }


def judge_ring_gqa(data) -> list[str]:
    ranks, lines = data["ranks"], []
    for heads, kv_heads in RING_HEADS:
        key, shape = str((heads, kv_heads)), f"nq={heads}, nkv={kv_heads}"
        q, k, v, g = (t.requires_grad_() for t in attention_problem(heads, kv_heads, P * RING_C, seed=60 + heads))
        reference = gqa_attention(q, k, v)  # one device, causal, grouped K/V heads
        (reference * g.detach()).sum().backward()
        expected = {"out": reference.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        side_by_side, error = _no_error(  # the ranks' blocks of tokens in order: [1, heads, T, HD]
            shape,
            lambda key=key, names=tuple(expected): {
                n: torch.cat([ranks[r][key][n] for r in range(P)], dim=-2) for n in names
            },
        )
        if error:
            lines += error
        else:
            lines.append(compare(f"{shape}: the attention output", side_by_side["out"], expected["out"]).line)
            grads = {n: side_by_side[n] for n in ("dq", "dk", "dv")}
            what = f"{shape}: dL/dq, dL/dk and dL/dv (the library's backward)"
            lines.append(compare(what, grads, {n: expected[n] for n in grads}).line)
        block = 2 * kv_heads * RING_C * HD * 8  # one K/V block [2, 1, nkv, c, HD]
        sent = [ranks[r][key]["sent"] for r in range(P)]
        wrong = next((r for r in range(P) if sent[r] != (P - 1) * block), None)
        what = (
            f"{shape}: bytes each rank sends in forward (P-1 K/V blocks of the {kv_heads} K/V heads, {(P - 1) * block})"
        )
        lines.append(f"{what}: " + ("PASS" if wrong is None else f"rank {wrong}: received {sent[wrong]}: FAIL"))
        if heads > kv_heads:
            copies = [ranks[r][key]["copies"] for r in range(P)]
            what = f"{shape}: tensors each rank's forward makes holding a K/V block copied for each query head"
            wrong = next((r for r in range(P) if copies[r]), None)
            lines.append(
                f"{what}: "
                + ("none: PASS" if wrong is None else f"rank {wrong}: expected none, received {copies[wrong]}: FAIL")
            )
    called = [c for res in ranks for part in res.values() for c in part["library"]]
    lines.append(library_verdict("ring_forward", called))
    return lines
