"""Lab 02's checks: the student's row-parallel linear layer, forward and backward, on live ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.check import check_equal, compare
from parlab.grading import probe, run_check

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
P, BATCH, T, IN, OUT = 4, 2, 16, 32, 24  # ranks; x: [BATCH, T, IN]; W: [OUT, IN]

STRUCTURAL = {
    "forward": "each rank all-reduces exactly one y ([B, T, out] floats) in forward, nothing else",
    "backward": "no communication at all in backward (counted at the process group, library calls included)",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def full_problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [BATCH, T, IN], W: [OUT, IN] and a fixed output gradient G: [BATCH, T, OUT] (the loss is sum(y * G))."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, T, IN), (OUT, IN), (BATCH, T, OUT)]
    x, w, g = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes)
    return x, w, g


def run_row_parallel(layer, backward: bool) -> dict:
    """Rank code: this rank's slices through `layer`, then (if asked) the backward of sum(y * G)."""
    r, k = dist.get_rank(), IN // P
    x, w, g = full_problem()
    x_r = x[..., r * k : (r + 1) * k].clone().requires_grad_()  # [B, T, k]: this rank's slice
    w_r = w[:, r * k : (r + 1) * k].clone().requires_grad_()  # [out, k]
    with probe.recording(keep_sent_data=False) as forward_calls:
        y = layer.apply(x_r, w_r)  # [B, T, out]
    with probe.recording(keep_sent_data=False) as backward_calls:
        if backward:
            (y * g).sum().backward()  # dL/dy = g on every rank
    return {
        "y": y.detach(),
        "grad_x": x_r.grad,
        "grad_w": w_r.grad,
        "forward": forward_calls,
        "backward": backward_calls,
    }


def single_device() -> dict:
    x, w, g = (t.requires_grad_() for t in full_problem())
    y = x @ w.T  # [B, T, out]
    (y * g.detach()).sum().backward()
    return {"y": y.detach(), "grad_x": x.grad, "grad_w": w.grad}


def _all_bytes(calls) -> int:
    """Bytes of every call, whatever its kind; a call without payload (a barrier) counts as one byte."""
    return sum(int(c["bytes"]) or 1 for c in calls)


# ------------------------------------------------------------------------------------------------ the checks


def collect_forward(row_parallel) -> dict:
    return {"ranks": list(parlab.launch(run_row_parallel, P, row_parallel, False, **LAUNCH))}


def judge_forward(data) -> list[str]:
    ranks, reference = data["ranks"], single_device()
    lines = [compare(f"rank {r}: y = x W^T", ranks[r]["y"], reference["y"], show=False).line for r in range(P)]
    for r in range(P):
        sent = _all_bytes(ranks[r]["forward"])  # all of it: any other communication is a FAIL
        what = f"rank {r}: bytes communicated in forward (one all-reduce of y)"
        lines.append(check_equal(what, sent, BATCH * T * OUT * 8, show=False).line)
    return lines


def collect_backward(row_parallel) -> dict:
    return {"ranks": list(parlab.launch(run_row_parallel, P, row_parallel, True, **LAUNCH))}


def judge_backward(data) -> list[str]:
    ranks, reference = data["ranks"], single_device()
    grad_x = torch.cat([res["grad_x"] for res in ranks], dim=-1)  # the ranks' slices side by side: [B, T, IN]
    grad_w = torch.cat([res["grad_w"] for res in ranks], dim=-1)  # [OUT, IN]
    lines = [
        compare("dL/dx, the ranks' slices side by side", grad_x, reference["grad_x"], show=False).line,
        compare("dL/dW, the ranks' slices side by side", grad_w, reference["grad_w"], show=False).line,
    ]
    for r in range(P):
        lines.append(
            check_equal(
                f"rank {r}: bytes communicated in backward", _all_bytes(ranks[r]["backward"]), 0, show=False
            ).line
        )
    return lines
