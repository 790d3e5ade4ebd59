"""Memory accounting: bytes counted from the tensors a rank actually holds.

Schemes that save memory (ZeRO partitions optimizer states, gradients and parameters; pipelines bound the
micro-batches in flight; sequence parallelism splits activations; offload moves state to CPU memory or disk)
prove it here, by counting tensors, never by formula alone. Each lesson prints the theory beside the count.

    held = state_bytes(model, optimizer)            # {"params": ..., "grads": ..., "optimizer": ...}
    with saved_activations() as saved:              # what autograd keeps for backward
        loss = model(x).sum()
    saved.bytes, saved.peak
    ledger = MemoryLedger(); ledger.record("after step 1", **held); ledger.peak()

A storage shared by several tensors (views, a tied embedding and LM head) is counted once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested lists, tuples, iterators, dicts (optimizer state dicts included) or a module."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):  # lists, tuples, generators
        for value in obj:
            yield from _tensors(value)


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())


def tensor_bytes(*objs: Any, device: str | None = None) -> int:
    """Bytes of the storages behind every tensor in `objs`, each storage counted once.

    device: count only tensors on this device type ("cpu", "cuda", "meta"); default all.
    """
    seen, total = set(), 0
    for obj in objs:
        for t in _tensors(obj):
            if device is not None and t.device.type != device:
                continue
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += key[3]
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """What a rank holds for training: parameter, gradient and optimizer-state bytes (Adam: m and v)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    held = {"params": tensor_bytes(params), "grads": tensor_bytes(grads)}
    if optimizer is not None:
        held["optimizer"] = tensor_bytes([state for state in optimizer.state.values()])
    return held


@dataclass
class SavedActivations:
    """Bytes of the tensors autograd saved for backward (parameters excluded), while the context was open."""

    bytes: int = 0
    count: int = 0
    _seen: set = field(default_factory=set, repr=False)


@contextmanager
def saved_activations(exclude: nn.Module | Iterable[torch.Tensor] | None = None) -> Iterator[SavedActivations]:
    """Count what the forward pass inside the block saves for backward: the activation memory a rank holds
    until that backward runs. Weights are not activations: any nn.Parameter, and any tensor sharing storage with
    `exclude` (a module's parameters, or the tensors given: e.g. views such as W^T that a linear layer saves)."""
    weights = exclude.parameters() if isinstance(exclude, nn.Module) else (exclude or [])
    excluded = {_storage_key(p) for p in weights}
    saved = SavedActivations()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if not isinstance(t, nn.Parameter) and key not in excluded and key not in saved._seen:
            saved._seen.add(key)
            saved.bytes += key[3]
            saved.count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


class MemoryLedger:
    """Snapshots of what a rank holds, by category, over a run; the peak is the max of the totals."""

    def __init__(self):
        self.rows: list[dict] = []

    def record(self, label: str, **categories: int) -> None:
        self.rows.append({"label": label, **categories, "total": sum(categories.values())})

    def peak(self) -> dict:
        """The snapshot with the largest total (empty dict if nothing was recorded)."""
        return max(self.rows, key=lambda row: row["total"], default={})
