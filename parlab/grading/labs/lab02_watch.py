"""Lab 02, part 2 (the check swiglu): what a student's forward does with torch, call by call.

`Watch` is a TorchFunctionMode the rank enters around the student's SwiGLU forward. It sees every tensor a torch
call returns and every matrix product, and keeps what the judge needs to tell a ring that never gathers the sequence
from one that does: the largest tensor made, the most numbers held at once (weak references to what the forward made,
a storage counted once), each GEMM's start, end and multiply-adds, and which hidden units' weights its operands copy.
"""

from __future__ import annotations

import math
import time
import weakref

import torch
import torch.nn.functional as F

_GEMMS = {  # the calls that multiply matrices, and the operand whose last dimension is the one summed over
    torch.matmul: 0,
    torch.Tensor.matmul: 0,
    torch.Tensor.__matmul__: 0,
    torch.Tensor.__rmatmul__: 1,
    torch.mm: 0,
    torch.Tensor.mm: 0,
    torch.bmm: 0,
    torch.Tensor.bmm: 0,
    F.linear: 0,
    torch.addmm: 1,
    torch.Tensor.addmm: 0,
    torch.baddbmm: 1,
    torch.Tensor.baddbmm: 0,
}


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _flat(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _flat(item)]
    return []


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


class Watch(torch.overrides.TorchFunctionMode):
    """Rank code: what the student's forward does with torch, call by call.

    - every tensor a call makes that is not a view of what the rank was handed: the numbers its storage holds (the
      largest one is kept, with the call that made it);
    - every matrix product (matmul, @, mm, bmm, linear, addmm, baddbmm, einsum): when it started and ended, its
      multiply-adds, and which hidden units' gate rows, up rows and down columns its operands are copies of
      (an operand [a, H] or [H, a] compared row by row, column by column, with the full weights)."""

    def __init__(self, handed: list[torch.Tensor], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.handed = {_storage(t) for t in handed}
        self.weights = {"gate": gate, "up": up, "down": down.T}  # [F, H] each: one row per hidden unit
        self.largest = {"numbers": 0, "shape": [], "call": ""}
        self.alive: list[tuple[weakref.ref, int, int]] = []  # (a tensor it made, its storage, the numbers held)
        self.peak = {"numbers": 0, "tensors": 0, "call": ""}  # the most numbers alive at once, after which call
        self.gemms: list[dict] = []
        self.units = {name: set() for name in self.weights}

    def _units(self, operands) -> None:
        H = self.weights["gate"].shape[1]
        for m in operands:
            if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.dtype != self.weights["gate"].dtype:
                continue
            for vectors in (m, m.T):
                if vectors.shape[1] != H:
                    continue
                for name, w in self.weights.items():
                    same = (vectors[:, None, :] == w[None, :, :]).all(dim=-1)  # [a, F]: row i is unit j's
                    self.units[name] |= set(same.any(dim=0).nonzero().flatten().tolist())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        end = time.perf_counter()
        name = getattr(func, "__name__", str(func))
        if func in _GEMMS or func is torch.einsum:
            operands = _flat(list(args[1:]) if func is torch.einsum else list(args))
            if func is torch.einsum:
                sizes = {}
                for letters, t in zip(args[0].replace(" ", "").split("->")[0].split(","), operands, strict=False):
                    sizes.update(zip(letters, t.shape, strict=False))
                work = math.prod(sizes.values())
            else:
                inner = operands[_GEMMS[func]].shape[-1] if len(operands) > _GEMMS[func] else 0
                work = out.numel() * inner
            self.gemms.append({"start": start, "end": end, "work": int(work), "call": name})
            self._units(operands)
        for t in _flat(out):
            storage = _storage(t)
            if storage in self.handed:
                continue  # a view of what the rank was handed: no new numbers held
            try:
                numbers = t.untyped_storage().nbytes() // t.element_size()
            except (RuntimeError, NotImplementedError):
                numbers = t.numel()
            if numbers > self.largest["numbers"]:
                self.largest = {"numbers": int(numbers), "shape": list(t.shape), "call": name}
            self.alive.append((weakref.ref(t), storage, int(numbers)))
        self._count(name)
        return out

    def _count(self, name: str) -> None:
        """What the forward holds right after a call: the numbers of every storage one of its tensors still uses
        (a storage counted once however many views use it)."""
        self.alive = [entry for entry in self.alive if entry[0]() is not None]
        held = {storage: numbers for _, storage, numbers in self.alive}
        total = sum(held.values())
        if total > self.peak["numbers"]:
            self.peak = {"numbers": total, "tensors": len(held), "call": name}
