"""Heterogeneous offload: the optimizer state in host memory (ZeRO-Offload) or on disk (ZeRO-Infinity).

Notation (lesson 06; lesson 05's): N data-parallel ranks, Psi parameters, b_c bytes per number of the compute copy
(the model's parameters and gradients), b_m bytes per number of the master weights and of Adam's m and v. The flat
layout is ZeRO's (parlab/schemes/zero/stages.py): each layer (unit) is a flat buffer padded to N x S_u, rank r owns
elements [r*S_u, (r+1)*S_u) of every unit; S = sum S_u is rank r's shard, N*S the padded Psi.

Three places a number can live: the DEVICE (the accelerator: fast, small), the HOST (CPU memory: large, and a CPU
runs Adam well enough), the DISK (NVMe: larger still, slower). ZeRO-2 keeps everything on the device; offload moves
what is touched once per step (gradients in, optimizer step, parameters out) off it:

    target   device                    host                              disk
    none     b_c N S + b_m S + 3 b_m S  -                                 -           (ZeRO-2, the reference)
    cpu      b_c N S                    b_m S grads + 3 b_m S master,m,v  -           (Ren et al. 2021, ZeRO-Offload)
    disk     b_c N S                    b_m S grads + read-ahead buffers  3 b_m S     (Rajbhandari et al. 2021)

The gradient shard is kept in the MASTER dtype (b_m S, `host_grad`): the reduce-scatter's output (b_c S bytes, what
the copy to the host moves) is converted on arrival, as DeepSpeed's ZeRO-1/2 optimizer keeps its gradient partition
in the dtype of its fp32 master partition. The ZeRO-Offload paper counts fp16 gradients on the host instead: with
b_c = 2, b_m = 4 on one rank its host holds 2 Psi + 12 Psi = 14 Psi, this table's 4 Psi + 12 Psi = 16 Psi (divide
by N per rank). Same arithmetic, same numbers: only the host bytes differ (lesson 06).

plus, on the device during backward, the gradient buckets in flight (at most two units' full gradients and their
reduce-scatter outputs: "grad buckets" in `offload_memory`). Activations are not model states: not counted here.

One step, the cpu target (ZeRO-Offload):
    forward, backward on the device; as soon as backward has produced a unit's gradients (a post-accumulate-grad
    hook), its reduce-scatter starts (rank r gets the sum of shard r); once it is done, the COPY ENGINE moves the
    shard to the host ("offload", kind on the timeline), while backward goes on with earlier layers.
    after backward: per unit, Adam on the host (kind "optimizer") on master, m, v and the host gradient / N; the
    copy engine moves the updated shard back to the device ("upload"), then an all-gather rebuilds the unit's full
    parameters on every rank. Adam of unit k overlaps the upload of unit k-1 and the all-gather of unit k-2.
The disk target (ZeRO-Infinity) keeps master, m and v in three memory-mapped files per rank; a read engine reads
unit k+1's state ("disk_read") while Adam steps unit k, and a write engine writes unit k back ("disk_write") after.

A copy engine is one background thread with a queue: it stands for a GPU's copy stream / DMA engine (one for the
device <-> host copies) or an NVMe queue (one for reads, one for writes). Operations it runs land on the timeline
with the times the thread measured. Under parlab.core.pace, a copy of n bytes is held to the link model's
alpha + n / bandwidth (the PCIe or NVMe link, modelled like the network).

The disk folder is always removed, also after a failure or an interrupt: parlab/core/scratch.py (`offload_folder`).

Numerics: the same arithmetic on the same numbers in every target (only WHERE the numbers live changes), so the
three targets end with identical parameters, and equal one device running torch.optim.Adam (float64 <= 1e-10).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from parlab.core import comm, pace
from parlab.core.memory import MemoryLedger, tensor_bytes
from parlab.core.models import lm_loss
from parlab.core.scratch import offload_folder
from parlab.schemes.data_parallel import shard_batch
from parlab.schemes.zero.stages import ReduceScatterGrads, adam_step, flatten, gather_master, plan_units
from parlab.schemes.zero.theory import OFFLOAD_TARGETS

TARGETS = OFFLOAD_TARGETS  # "none": plain ZeRO-2; "cpu": host memory; "disk": files
PLACES = ("device", "host", "disk")


class DiskState:
    """Rank r's optimizer state on disk: one memory-mapped file per state (master, m, v), [S] numbers each.

    read(a, b) copies elements [a, b) of each file into host memory; write(a, b, tensors) copies them back.
    """

    def __init__(self, folder: Path, init: dict[str, torch.Tensor], pin: bool = False):
        self.folder, self.pin = folder, pin  # pin: read into page-locked memory (a GPU's copy engine reads it)
        self.maps = {}
        for name, tensor in init.items():  # [S] each
            array = tensor.detach().cpu().numpy()
            mm = np.memmap(folder / f"{name}.bin", dtype=array.dtype, mode="w+", shape=array.shape)
            mm[:] = array
            mm.flush()
            self.maps[name] = mm

    def read(self, a: int, b: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, mm in self.maps.items():
            data = torch.from_numpy(np.array(mm[a:b]))  # a copy in host memory
            out[name] = data.pin_memory() if self.pin else data  # pinned: the upload to the GPU is asynchronous
        return out

    def write(self, a: int, b: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, mm in self.maps.items():
            mm[a:b] = tensors[name].numpy()

    def flush(self) -> None:
        for mm in self.maps.values():
            mm.flush()

    def nbytes(self) -> int:
        """Bytes of the files on disk, measured (os.stat)."""
        return sum(os.stat(self.folder / f"{name}.bin").st_size for name in self.maps)

    def close(self) -> None:
        self.maps = {}  # the last references: the mappings are closed


# ------------------------------------------------------------------------------------------- the copy engine


class CopyEngine:
    """One background thread that runs copies in order (a GPU copy stream, an NVMe queue), so that they overlap
    the compute of the main thread. submit() returns a Future; the operations are put on this rank's timeline by
    the main thread (record_finished), with the times the engine measured."""

    def __init__(self, device: torch.device):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-engine")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.done: list[tuple[str, str, float, float, int, int]] = []  # label, kind, start, end, bytes, step
        self.model = pace.active()  # the emulated link, read here: the thread has no pace context of its own

    def submit(self, label: str, kind: str, nbytes: int, step: int, work: Callable[[], object]) -> Future:
        def run():
            start = time.perf_counter()
            if self.stream is not None:  # a thread starts on GPU 0: name the rank's GPU, then its copy stream
                with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
                    value = work()
                self.stream.synchronize()
            else:
                value = work()
            if self.model is not None:  # an emulated PCIe / NVMe link: alpha + bytes / bandwidth
                time.sleep(max(0.0, start + self.model.comm_seconds(nbytes) - time.perf_counter()))
            self.done.append((label, kind, start, time.perf_counter(), nbytes, step))
            return value

        return self.pool.submit(run)

    def record_finished(self) -> None:
        """Put the finished operations on the timeline (from the main thread: comm's record of this rank)."""
        done, self.done = self.done, []
        for label, kind, start, end, nbytes, step in done:
            with comm.span(label, kind=kind, step=step) as event:
                pass
            event.start, event.end, event.bytes = start, end, nbytes  # the engine's times, not this moment's

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# ----------------------------------------------------------------------------------- ZeRO-2 with offload


class OffloadAdam(ReduceScatterGrads):
    """ZeRO-2 over `group` (default all ranks) with Adam, its optimizer state on the device, host or disk.

        opt = OffloadAdam(model, target="cpu", lr=1e-3)   # the same model on every rank of the group
        loss.backward()       # hooks: reduce-scatter each unit, copy its gradient shard to the host
        opt.step(step)        # Adam on the host (disk: with read-ahead), upload, all-gather the parameters
        opt.close()           # always (finally): stops the copy engines, removes this rank's files

    target: "none" (everything on the device: plain ZeRO-2), "cpu" or "disk". folder: where the disk target writes
    its files (it must exist; default: a new folder, removed by close()). compute_dtype: the model's parameters
    and gradients (default the model's dtype); master, m, v are in the model's dtype.
    """

    def __init__(
        self, model, *, target="cpu", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, folder=None, compute_dtype=None, group=None
    ):
        if target not in TARGETS:
            raise ValueError(f"target={target!r} must be one of {TARGETS}")
        self.model, self.target, self.group = model, target, group
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0
        self.N, self.rank = comm.group_size(group), comm.group_rank(group)
        self.device = next(model.parameters()).device
        self.master_dtype = next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        self.units = plan_units(model, self.N)
        N, r = self.N, self.rank
        self.S = S = sum(u.shard_numel for u in self.units)  # rank r's flat shard: its piece of every unit
        # Where the optimizer lives: the device for "none", the host (CPU memory) otherwise.
        opt_place = self.device if target == "none" else torch.device("cpu")
        # Page-locked host memory for what the copy engine moves (gradients in, master weights out): a GPU's DMA
        # engine copies it asynchronously, on the engine's CUDA stream; from pageable memory a copy is synchronous.
        pin = target != "none" and self.device.type == "cuda"
        master = torch.cat([self._mine(u, flatten(u.params, N * u.shard_numel)) for u in self.units]).to(opt_place)
        master = master.pin_memory() if pin and target == "cpu" else master  # disk: its read buffers are pinned
        self.host_grad = torch.zeros(S, dtype=self.master_dtype, device=opt_place, pin_memory=pin)  # [S]
        self.state, self.disk, self._folder_cm = {}, None, None
        init = {"master": master, "m": torch.zeros_like(master), "v": torch.zeros_like(master)}  # [S] each
        if target == "disk":  # master, m, v in files; only read-ahead buffers in host memory
            if folder is None:
                self._folder_cm = offload_folder()
                folder = self._folder_cm.__enter__()
            self.folder = Path(folder) / f"rank{r}"
            self.folder.mkdir(parents=True, exist_ok=True)
            self.disk = DiskState(self.folder, init, pin=pin)
        else:
            self.state = init
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}  # disk: unit k's state read into host memory
        # The compute copy on the device: each unit's parameters become views of a flat buffer [N*S_u].
        for u in self.units:
            u.flat = flatten(u.params, N * u.shard_numel, self.compute_dtype)
            offset = 0
            for p in u.params:
                p.data = u.flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self.pcie = CopyEngine(self.device)  # device <-> host copies
        self.reader, self.writer = (CopyEngine(self.device), CopyEngine(self.device)) if self.disk else (None, None)
        self.copies: list[Future] = []  # gradient copies to the host in flight
        self.to_reduce = len(self.units) - 1  # units are reduce-scattered last to first, on every rank
        self.in_flight = []  # units whose reduce-scatter is in flight, oldest first
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for u in self.units for p in u.params]
        self.ledger, self.step_now = MemoryLedger(), 0

    def _mine(self, u, flat: torch.Tensor) -> torch.Tensor:
        """Rank r's slice of unit u's flat buffer [N*S_u] -> [S_u] (a view)."""
        return flat[self.rank * u.shard_numel : (self.rank + 1) * u.shard_numel]

    # -- during backward: reduce-scatter each unit, then move its gradient shard to the host -------------------

    def _grad_out(self, u) -> torch.Tensor:
        return torch.empty(u.shard_numel, dtype=self.compute_dtype, device=self.device)  # [S_u] shard r's sum

    def _flattened(self, u, flat: torch.Tensor, out: torch.Tensor) -> None:
        u.reduce_work = (None, flat, out)
        self.record("bucket flattened")  # the peak: the unit's .grad, its flat copy and the unit before it

    def _arrived(self, u, out: torch.Tensor) -> None:
        """Unit u's gradient shard has arrived: hand it to the copy engine (device -> host)."""
        host = self.host_grad[u.offset : u.offset + u.shard_numel]  # [S_u] on the host (device: "none")
        if self.target == "none":
            host.copy_(out)
        else:  # device -> host, in the background while backward goes on
            job = lambda host=host, out=out: host.copy_(out, non_blocking=True)  # noqa: E731
            self.copies.append(self.pcie.submit(f"grads {u.name}", "offload", _nbytes(out), self.step_now, job))

    # -- the step: Adam where the state lives, parameters back to the device, all-gathered ----------------------

    def step(self, step: int = 0) -> None:
        """After backward: every gradient shard on the host; then per unit, Adam where its state lives, the updated
        slice back to the device, and an all-gather of the unit's parameters (unit k-1's while unit k is stepped)."""
        self.finish_backward()  # units with an unused parameter (zero gradient); every reduce-scatter arrived
        for copy in self.copies:  # every gradient shard is on the host
            copy.result()
        self.copies = []
        self.record("before the optimizer step")
        self.t += 1
        reads = {0: self._read(0, step)} if self.disk else {}  # disk: unit 0's state now, then one unit ahead
        uploads, gathers, writes = [], [], []
        for k, u in enumerate(self.units):
            a, b = u.offset, u.offset + u.shard_numel
            state = self._state_of(k, step, reads, writes)  # {master, m, v} [S_u] each, in host memory
            grad = self.host_grad[a:b].div_(self.N)  # sum over ranks -> mean, [S_u]
            with comm.span(f"Adam {u.name}", kind="optimizer", step=step):
                adam_step(state["master"], grad, state["m"], state["v"], self.t, self.lr, self.betas, self.eps)
            if self.disk is not None:  # back to the file, in the background
                job = lambda k=k, a=a, b=b, state=state: self._write_back(k, a, b, state)  # noqa: E731
                writes.append(self.writer.submit(f"state {u.name}", "disk_write", _nbytes(state), step, job))
            uploads.append(self._upload(u, state["master"], step))
            if k > 0:
                gathers.append(self._gather(self.units[k - 1], uploads[k - 1]))
        gathers.append(self._gather(self.units[-1], uploads[-1]))
        comm.wait_all(gathers)
        if self.disk is not None:
            self.writer.submit("flush", "disk_write", 0, step, self.disk.flush).result()  # every write is done
        for engine in (self.pcie, self.reader, self.writer):
            if engine is not None:
                engine.record_finished()

    def _state_of(self, k: int, step: int, reads: dict, writes: list) -> dict[str, torch.Tensor]:
        """Unit k's master, m, v [S_u] each: views of the state in memory; disk: the read started one unit ago
        (waited for here), and unit k+1's read started now, while unit k is stepped."""
        u = self.units[k]
        if self.disk is None:
            return {name: t[u.offset : u.offset + u.shard_numel] for name, t in self.state.items()}
        if k >= 2:
            writes[k - 2].result()  # at most 3 units in host memory: k-1 being written, k stepped, k+1 read
        if k + 1 < len(self.units):
            reads[k + 1] = self._read(k + 1, step)
        self.buffers[k] = state = reads.pop(k).result()
        self.record(f"state of {u.name} read")
        return state

    def _read(self, k: int, step: int) -> Future:
        u = self.units[k]
        nbytes = 3 * u.shard_numel * torch.finfo(self.master_dtype).bits // 8
        job = lambda: self.disk.read(u.offset, u.offset + u.shard_numel)  # noqa: E731
        return self.reader.submit(f"state {u.name}", "disk_read", nbytes, step, job)

    def _write_back(self, k: int, a: int, b: int, state: dict[str, torch.Tensor]) -> None:
        self.disk.write(a, b, state)
        self.buffers.pop(k, None)  # the host buffer of unit k is free again

    def _upload(self, u, master: torch.Tensor, step: int) -> Future | None:
        """Rank r's updated slice [S_u] -> its place in the unit's device parameters (cpu, disk: host -> device
        in the background)."""
        mine = self._mine(u, u.flat)  # [S_u] rank r's slice of the device parameters
        if self.target == "none":
            mine.copy_(master)
            return None
        job = lambda: mine.copy_(master, non_blocking=True)  # noqa: E731
        return self.pcie.submit(f"params {u.name}", "upload", _nbytes(mine), step, job)

    def _gather(self, u, upload: Future | None):
        """Once rank r's slice is on the device: every rank's slice -> the unit's full parameters, in place."""
        if upload is not None:
            upload.result()
        mine = self._mine(u, u.flat)
        return comm.all_gather_into_tensor(u.flat, mine, group=self.group, async_op=True, label=f"params {u.name}")

    # -- what lives where ------------------------------------------------------------------------------------

    def held(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds now, by place and by what they are, counted from its tensors and files."""
        live_grads = [p.grad for u in self.units for p in u.params if p.grad is not None]
        buckets = [u.reduce_work[1:] for u in self.units if u.reduce_work is not None]
        optimizer = tensor_bytes(self.state)
        grads = tensor_bytes(self.host_grad)
        device = {
            "params": tensor_bytes([u.flat for u in self.units]),
            "grad buckets": tensor_bytes(live_grads, buckets),
        }
        host = {}
        if self.target == "none":
            device.update({"grads": grads, "optimizer": optimizer})
        else:
            host = {"grads": grads, "optimizer": optimizer, "read-ahead": tensor_bytes(list(self.buffers.values()))}
        disk = {"optimizer": self.disk.nbytes()} if self.disk is not None else {}
        return {"device": device, "host": host, "disk": disk}

    def record(self, label: str) -> None:
        """A snapshot of held() in the ledger (and, on a GPU, torch.cuda.memory_allocated beside it)."""
        held = self.held()
        row = {f"{place}:{what}": n for place, parts in held.items() for what, n in parts.items()}
        if self.device.type == "cuda":  # the real figure, beside our count
            row["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
        self.ledger.record(label, **row)
        self.ledger.rows[-1]["step"] = self.step_now

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter in the master dtype, gathered from all ranks' master shards (for checks)."""
        master = self.state["master"] if self.disk is None else self.disk.read(0, self.S)["master"]
        return gather_master(master.to(self.device), self.units, self.group)

    def close(self) -> None:
        """Stop the copy engines, detach the hooks, and remove this rank's files (and its own folder)."""
        for hook in self.hooks:
            hook.remove()
        for engine in (self.pcie, self.reader, self.writer):
            if engine is not None:
                engine.close()
        if self.disk is not None:
            self.disk.close()
            shutil.rmtree(self.folder, ignore_errors=True)
        if self._folder_cm is not None:
            self._folder_cm.__exit__(None, None, None)


def _nbytes(tensors) -> int:
    """Bytes of a tensor, or of the tensors of a dict."""
    tensors = tensors.values() if isinstance(tensors, dict) else [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------- the training loop


def train_offload(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    target: str = "cpu",
    lr: float = 1e-3,
    folder: str | Path | None = None,
    compute_dtype: torch.dtype | None = None,
    group=None,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """Rank code: train `model` (the same full model on every rank of `group`) with ZeRO-2, Adam and the
    optimizer state on `target` ("none", "cpu", "disk").

    batches: the GLOBAL batches [B, T], the same on every rank; rank r trains on its b = B/N rows.
    Returns this rank's losses, the final parameters (gathered, master dtype), the memory ledger (bytes by place,
    at each moment of each step), the steady state and peak by place, and the units.
    """
    N, rank = comm.group_size(group), comm.group_rank(group)
    loss_fn = loss_fn or (lambda model, x, y: lm_loss(model(x), y))
    opt = OffloadAdam(model, target=target, lr=lr, folder=folder, compute_dtype=compute_dtype, group=group)
    try:
        losses = []
        for step, (x, y) in enumerate(batches):
            opt.step_now = step
            x_r, y_r = shard_batch(x, y, rank, N)  # [b, T] each
            x_r, y_r = x_r.to(opt.device), y_r.to(opt.device)
            with comm.span("forward", kind="forward", step=step):
                loss = loss_fn(model, x_r, y_r)
            opt.record("after forward")
            with comm.span("backward", kind="backward", step=step):
                loss.backward()  # reduce-scatters and copies to the host start in here
            opt.step(step)
            opt.record("after the step")
            losses.append(loss.item())
            comm.progress(step + 1, len(batches))
        rows = opt.ledger.rows
        steady = next(row for row in reversed(rows) if row["label"] == "before the optimizer step")
        keys = [k for k in rows[0] if ":" in k]
        out = {
            "losses": losses,
            "params": opt.full_params(),
            "ledger": rows,
            "steady": by_place({k: steady[k] for k in keys}),
            "peak": by_place({k: max(row.get(k, 0) for row in rows) for k in keys}),
            "units": [(u.name, u.numel, u.shard_numel) for u in opt.units],
            "cuda_allocated_peak": max((row.get("cuda_allocated", 0) for row in rows), default=0),
        }
    finally:
        opt.close()  # also after an exception: no thread left running, no file left on disk
    return out


def by_place(flat: dict[str, int]) -> dict[str, dict[str, int]]:
    """{"device:params": n, ...} -> {"device": {"params": n, ...}, "host": {...}, "disk": {...}}."""
    out: dict[str, dict[str, int]] = {place: {} for place in PLACES}
    for key, n in flat.items():
        place, what = key.split(":", 1)
        out[place][what] = n
    return out
