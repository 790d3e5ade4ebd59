"""Lab 03's zero-bubble check: a stage's backward split into input (BI) and weight (BW) gradients, run in two action
orders against autograd, with the FLOPs of each call counted at the aten level."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parlab.core.check import compare
from parlab.schemes.pipeline.schedules import zero_bubble_h1

ZB_H, ZB_B, ZB_M = 8, 2, 8  # the zero-bubble stage: hidden size, micro-batch rows, micro-batches

# ------------------------------------------------------------------------------------------- zero bubble


def zero_bubble_problem(seed: int = 1) -> dict[str, torch.Tensor]:
    """W1, W2: [H, H]; the micro-batches' inputs x and output gradients g: [m, b, H] each."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "w1": randn(ZB_H, ZB_H),
        "w2": randn(ZB_H, ZB_H),
        "x": randn(ZB_M, ZB_B, ZB_H),
        "g": randn(ZB_M, ZB_B, ZB_H),
    }


def zero_bubble_orders() -> dict[str, list[tuple[str, int]]]:
    """The two orders of one stage's actions the check runs: the last rank's in ZB-H1 (p = 4), which postpones
    each BW by four actions, and the most deferred order of all."""
    zb = [(a.op, a.mb) for a in zero_bubble_h1(4, ZB_M).actions[3]]
    deferred = [("F", i) for i in range(ZB_M)] + [("BI", i) for i in range(ZB_M)]
    deferred += [("BW", i) for i in reversed(range(ZB_M))]
    return {"ZB-H1 order of the last rank": zb, "every BW postponed to the end": deferred}


class GemmFlops(TorchDispatchMode):
    """Counts the FLOPs of the matrix products run inside it (2 M K N per [M, K] x [K, N]), at the level of aten
    operators, so `@`, einsum, F.linear and autograd's own backward products all count."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's default would import torch._dynamo (seconds) for nothing here

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op, aten = func.overloadpacket, torch.ops.aten
        if op in (aten.mm, aten.bmm, aten.mv, aten.dot):  # [.., M, K] x [.., K, N]
            self.flops += 2 * args[0].numel() * (args[1].shape[-1] if args[1].dim() > 1 else 1)
        elif op in (aten.addmm, aten.baddbmm, aten.addmv):  # bias + [.., M, K] x [.., K, N]
            self.flops += 2 * args[1].numel() * (args[2].shape[-1] if args[2].dim() > 1 else 1)
        return out


def collect_zero_bubble(stage_class) -> dict:
    problem, out = zero_bubble_problem(), {}
    for name, actions in zero_bubble_orders().items():
        stage = stage_class(problem["w1"].clone(), problem["w2"].clone())
        dx, flops = [None] * ZB_M, {"BI": [], "BW": []}
        for op, mb in actions:
            if op == "F":
                stage.forward(mb, problem["x"][mb].clone())
                continue
            with GemmFlops() as counter:
                if op == "BI":
                    dx[mb] = stage.backward_input(mb, problem["g"][mb].clone())
                else:
                    stage.backward_weight(mb)
            flops[op].append(counter.flops)
        out[name] = {"dx": dx, "grad_w1": stage.grad_w1, "grad_w2": stage.grad_w2, "flops": flops}
    return {"orders": out}


def zero_bubble_reference() -> dict:
    """autograd on one stage: d loss / d x of every micro-batch, and the weight gradients summed over them."""
    problem = zero_bubble_problem()
    w1, w2 = problem["w1"].clone().requires_grad_(), problem["w2"].clone().requires_grad_()
    dx = []
    for x, g in zip(problem["x"], problem["g"], strict=True):
        x = x.clone().requires_grad_()
        y = torch.tanh(x @ w1.T) @ w2.T
        (y * g).sum().backward()  # dL/dy = g
        dx.append(x.grad)
    return {"dx": dx, "grad_w1": w1.grad, "grad_w2": w2.grad}


def judge_zero_bubble(data) -> list[str]:
    reference, lines = zero_bubble_reference(), []
    gemm = 2 * ZB_B * ZB_H * ZB_H  # FLOPs of one [b, H] x [H, H] product (or [H, b] x [b, H])
    for name in zero_bubble_orders():
        got = data["orders"][name]
        lines.append(compare(f"{name}: dL/dx from each BI", got["dx"], reference["dx"]).line)
        weights = [got["grad_w1"], got["grad_w2"]]
        expected = [reference["grad_w1"], reference["grad_w2"]]
        lines.append(compare(f"{name}: dL/dW1, dL/dW2 after the last BW", weights, expected).line)
        for op in ("BI", "BW"):
            flops = got["flops"][op]
            if len(flops) != ZB_M:
                verdict = f"{len(flops)} of {ZB_M} ran: FAIL"
            else:
                most = max(flops)
                verdict = "PASS" if most <= 2 * gemm else f"one used {most}: FAIL"
            lines.append(f"{name}: every {op} within the budget of two GEMMs, {2 * gemm} FLOPs: {verdict}")
    return lines
