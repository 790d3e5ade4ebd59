"""Lab 03's zero-bubble check: the lab model's SwiGLU MLP (parlab.core.lab_model, no biases) as a pipeline stage
whose backward is split by hand into input (BI) and weight (BW) gradients, within a memory budget for what a
micro-batch may keep between its BI and its BW (less than every product's input and output gradient: something
must be recomputed), run in two action orders against autograd. The check counts the FLOPs of the matrix products
of each call at the aten level, the bytes of the tensors the stage holds after each call, and refuses autograd."""

from __future__ import annotations

import types
from collections import deque

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab03_setup import LIBRARY
from parlab.schemes.pipeline.schedules import zero_bubble_h1

ZB_CFG = LabConfig()  # the lab model: H = 32, F = 64 (SwiGLU width), float64
ZB_B, ZB_T, ZB_M = 2, 4, 8  # micro-batch [b, T, H]; m micro-batches
ZB_LAYER = 1  # the stage is the MLP of this block of the lab model

# The budgets, per micro-batch. FLOPs: matrix products of [b T, H] x [H, F] (or its transposes), 2 b T H F each.
PRODUCTS = {"BI": 3, "BW": 5}
# Bytes held between calls, in numbers per token of the micro-batch (float64): from its F to its BI, what a
# forward naturally keeps (x, and the gate's and the up projection's outputs); from its BI to its BW, x, dL/dy and
# one [b, T, F] tensor: less than the 2H + 3F of every product's input and output gradient.
HELD_PER_TOKEN = {"F": ZB_CFG.hidden + 2 * ZB_CFG.ffn, "BI": 2 * ZB_CFG.hidden + ZB_CFG.ffn}
BUDGET_TEXT = "H + 2F numbers per token from F to BI, 2H + F from BI to BW, nothing after BW"

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


_OPAQUE = (type, types.ModuleType, types.BuiltinFunctionType, types.MethodType, str, bytes, int, float, bool)


def held_tensors(stage) -> dict[int, tuple[str, list[int], int]]:
    """Every tensor storage reachable from the stage object (its attributes, the containers and objects in them, the
    closures of functions it keeps, its class's attributes): {storage address: (where, shape, bytes)}. A view keeps
    its whole storage alive, so a storage counts whole, and once however many tensors share it."""
    found: dict[int, tuple[str, list[int], int]] = {}
    seen: set[int] = set()
    todo = deque([("self", stage)])
    todo += [(f"{type(stage).__name__}.{k}", v) for k, v in vars(type(stage)).items() if not k.startswith("__")]
    while todo and len(seen) < 100_000:
        where, obj = todo.popleft()
        if id(obj) in seen or isinstance(obj, _OPAQUE) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            found.setdefault(storage.data_ptr(), (where, list(obj.shape), storage.nbytes()))
        elif isinstance(obj, dict):
            todo += [(f"{where}[{k!r}]", v) for k, v in obj.items()] + [(f"{where} key", k) for k in obj]
        elif isinstance(obj, (list, tuple, deque, set, frozenset)):
            todo += [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, types.FunctionType):  # a lambda or closure kept on the stage: what it captured
            todo += [(f"{where} closure", c.cell_contents) for c in obj.__closure__ or () if _filled(c)]
        elif hasattr(obj, "__dict__"):
            todo += [(f"{where}.{k}", v) for k, v in vars(obj).items()]
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _storages(*tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def collect_zero_bubble(stage_class) -> dict:

    problem, out, orders = zero_bubble_problem(), {}, zero_bubble_orders()
    with library_calls(LIBRARY) as called:
        for name, actions in orders.items():
            weights = [problem["w_gate"].clone(), problem["w_up"].clone(), problem["w_down"].clone()]
            stage = stage_class(*weights)
            # Not counted: what the stage held once built (its weights, its gradient accumulators, anything made
            # there), kept alive here so that no later tensor can take one of those addresses.
            built = list(held_tensors(stage))
            keep = [stage.__dict__.copy(), weights]
            dx, flops, autograd, held = [None] * ZB_M, {"BI": [], "BW": []}, "", []
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
                skip = set(built) | _storages(*(getattr(stage, g, None) for g in ("grad_gate", "grad_up", "grad_down")))
                tensors = {ptr: t for ptr, t in held_tensors(stage).items() if ptr not in skip}
                held.append([op, mb, sorted(tensors.values(), key=lambda t: -t[2])])
            del keep
            grads = {"gate": stage.grad_gate, "up": stage.grad_up, "down": stage.grad_down}
            out[name] = {"dx": dx, "grads": grads, "flops": flops, "autograd": autograd, "held": held}
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


def budget_bytes(states: dict[int, str]) -> int:
    """What the micro-batches in `states` (mb -> "F" between F and BI, "BI" between BI and BW) may hold."""
    per_token = sum(HELD_PER_TOKEN[state] for state in states.values())
    return per_token * ZB_B * ZB_T * ZB_CFG.torch_dtype.itemsize


def _over_budget(held: list) -> tuple[str, int]:
    """(the first call after which the stage held more than its budget, in words; the most bytes held)."""
    states: dict[int, str] = {}
    most = 0
    for op, mb, tensors in held:
        if op == "BW":
            states.pop(mb, None)
        else:
            states[mb] = op
        total = sum(t[2] for t in tensors)
        most = max(most, total)
        allowed = budget_bytes(states)
        if total > allowed:
            between = [sum(1 for s in states.values() if s == kind) for kind in ("F", "BI")]
            largest = ", ".join(f"{where} {shape} {n:,} B" for where, shape, n in tensors[:3])
            return (
                f"after {op}{mb} the stage held {total:,} bytes, its budget {allowed:,} (micro-batches between F and "
                f"BI: {between[0]}, between BI and BW: {between[1]}); the largest: {largest}"
            ), most
    return "", most


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
            ran, limit = got["flops"][op], PRODUCTS[op] * gemm
            over = next(((mb, f) for mb, f in ran if f > limit), None)
            if len(ran) != ZB_M:
                verdict = f"{len(ran)} of {ZB_M} ran: FAIL"
            elif over is not None:
                verdict = f"{op}{over[0]} used {over[1]:,} ({over[1] / gemm:g} products): FAIL"
            else:
                verdict = "PASS"
            words = {3: "three", 5: "five"}[PRODUCTS[op]]
            lines.append(f"{name}: every {op} within {words} products, {limit:,} FLOPs: {verdict}")
        over, most = _over_budget(got["held"])
        lines.append(f"{name}: the most bytes the stage held after a call: {most:,}")  # shown, not scored
        verdict = "PASS" if not over else f"{over}: FAIL"
        lines.append(f"{name}: tensors held after every call within {BUDGET_TEXT}: {verdict}")
        verdict = "PASS" if not got["autograd"] else f"{got['autograd']}: FAIL"
        lines.append(f"{name}: no autograd, every gradient by hand: {verdict}")
    return lines
