"""Lab 03's zero-bubble check: the lab model's SwiGLU MLP (parlab.core.lab_model, no biases) as a pipeline stage
whose backward is split by hand into input (BI) and weight (BW) gradients, run in two action orders against
autograd, with the matrix products of each call counted at the aten level and autograd itself refused."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model
from parlab.grading.labs.guard import library_calls, library_line
from parlab.schemes.pipeline.schedules import zero_bubble_h1

ZB_CFG = LabConfig()  # the lab model: H = 32, F = 64 (SwiGLU width), float64
ZB_B, ZB_T, ZB_M = 2, 4, 8  # micro-batch [b, T, H]; m micro-batches
ZB_LAYER = 1  # the stage is the MLP of this block of the lab model

# ------------------------------------------------------------------------------------------- zero bubble


def zero_bubble_problem(seed: int = 1) -> dict[str, torch.Tensor]:
    """The stage's weights, from the lab model (gate, up: [F, H]; down: [H, F]), and the micro-batches' inputs x
    and output gradients g: [m, b, T, H] each."""
    mlp = build_lab_model(ZB_CFG, seed=3).blocks[ZB_LAYER].mlp
    gen = torch.Generator().manual_seed(seed)
    shape = (ZB_M, ZB_B, ZB_T, ZB_CFG.hidden)
    return {
        "w_gate": mlp.gate.weight.detach().clone(),
        "w_up": mlp.up.weight.detach().clone(),
        "w_down": mlp.down.weight.detach().clone(),
        "x": torch.randn(shape, generator=gen, dtype=torch.float64),  # host: the seeded draw (run in the kernel)
        "g": torch.randn(shape, generator=gen, dtype=torch.float64),  # host: the seeded draw
    }


def zero_bubble_orders() -> dict[str, list[tuple[str, int]]]:
    """The two orders of one stage's actions the check runs: the last rank's in ZB-H1 (p = 4), which postpones
    each BW by four actions, and the most deferred order of all."""
    zb = [(a.op, a.mb) for a in zero_bubble_h1(4, ZB_M).actions[3]]
    deferred = [("F", i) for i in range(ZB_M)] + [("BI", i) for i in range(ZB_M)]
    deferred += [("BW", i) for i in reversed(range(ZB_M))]
    return {"ZB-H1 order of the last rank": zb, "every BW postponed to the end": deferred}


class Counter(TorchDispatchMode):
    """Watches the aten operators run inside it: the FLOPs of the matrix products (2 M K N per [M, K] x [K, N]), so
    `@`, einsum, F.linear and autograd's own products all count, and the first operator that had a tensor requiring
    gradients (autograd recording a graph)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's default would import torch._dynamo (seconds) for nothing here

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.autograd = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op, aten = func.overloadpacket, torch.ops.aten
        if op in (aten.mm, aten.bmm, aten.mv, aten.dot):  # [.., M, K] x [.., K, N]
            self.flops += 2 * args[0].numel() * (args[1].shape[-1] if args[1].dim() > 1 else 1)
        elif op in (aten.addmm, aten.baddbmm, aten.addmv):  # bias + [.., M, K] x [.., K, N]
            self.flops += 2 * args[1].numel() * (args[2].shape[-1] if args[2].dim() > 1 else 1)
        flat = [*args, *(kwargs or {}).values()]
        if not self.autograd and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            self.autograd = str(op.__name__)
        return out


def collect_zero_bubble(stage_class) -> dict:
    from parlab.grading.labs.lab03_pipeline_1f1b import LIBRARY  # the lab's one list (its main module)

    problem, out, orders = zero_bubble_problem(), {}, zero_bubble_orders()
    with library_calls(LIBRARY) as called:
        for name, actions in orders.items():
            stage = stage_class(problem["w_gate"].clone(), problem["w_up"].clone(), problem["w_down"].clone())
            dx, flops, autograd = [None] * ZB_M, {"BI": [], "BW": []}, ""
            for op, mb in actions:
                with Counter() as counter:
                    if op == "F":
                        stage.forward(mb, problem["x"][mb].clone())
                    elif op == "BI":
                        dx[mb] = stage.backward_input(mb, problem["g"][mb].clone())
                    else:
                        stage.backward_weight(mb)
                if op != "F":
                    flops[op].append([mb, counter.flops])
                if counter.autograd and not autograd:
                    autograd = f"{op}{mb} ran aten.{counter.autograd} on a tensor that requires grad"
            grads = {"gate": stage.grad_gate, "up": stage.grad_up, "down": stage.grad_down}
            out[name] = {"dx": dx, "grads": grads, "flops": flops, "autograd": autograd}
    return {"orders": out, "library": called}


def zero_bubble_reference() -> dict:
    """autograd on one stage: d loss / d x of every micro-batch, and the weight gradients summed over them."""
    problem = zero_bubble_problem()
    weights = {name: problem[f"w_{name}"].clone().requires_grad_() for name in ("gate", "up", "down")}
    dx = []
    for x, g in zip(problem["x"], problem["g"], strict=True):
        x = x.clone().requires_grad_()
        y = (torch.nn.functional.silu(x @ weights["gate"].T) * (x @ weights["up"].T)) @ weights["down"].T
        (y * g).sum().backward()  # dL/dy = g
        dx.append(x.grad)
    return {"dx": dx, "grads": {name: w.grad for name, w in weights.items()}}


def judge_zero_bubble(data) -> list[str]:
    reference = zero_bubble_reference()
    lines = [library_line("your split stage", data.get("library", ["(calls not recorded)"]))]
    tokens, hidden, ffn = ZB_B * ZB_T, ZB_CFG.hidden, ZB_CFG.ffn
    gemm = 2 * tokens * hidden * ffn  # FLOPs of one [b T, H] x [H, F] product (or [F, b T] x [b T, H], ...)
    for name in zero_bubble_orders():
        got = data["orders"][name]
        lines.append(compare(f"{name}: dL/dx from each BI", got["dx"], reference["dx"]).line)
        lines.append(
            compare(f"{name}: dL/dW of gate, up, down after the last BW", got["grads"], reference["grads"]).line
        )
        for op in ("BI", "BW"):
            ran = got["flops"][op]
            over = next(((mb, f) for mb, f in ran if f > 3 * gemm), None)
            if len(ran) != ZB_M:
                verdict = f"{len(ran)} of {ZB_M} ran: FAIL"
            elif over is not None:
                verdict = f"{op}{over[0]} used {over[1]}: FAIL"
            else:
                verdict = "PASS"
            lines.append(f"{name}: every {op} within three products, {3 * gemm} FLOPs: {verdict}")
        verdict = "PASS" if not got["autograd"] else f"{got['autograd']}: FAIL"
        lines.append(f"{name}: no autograd, every gradient by hand: {verdict}")
    return lines
