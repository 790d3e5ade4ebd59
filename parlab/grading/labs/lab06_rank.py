"""Lab 06's emulated rank: its device and host memory (`Memory`), the link between them (`Link`), LAMB's pieces the
lab hands out (`Lamb`: Adam's moments, Adam's direction, the scaled update), ZeRO-2's layout of the lab model on
them with one unit per tensor, and the rank code of the serial and overlap checks (see lab06_offload.py for what
each piece is)."""

from __future__ import annotations

import itertools
import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.lab_model import LabConfig, build_lab_model, lab_loss
from parlab.core.memory import tensor_bytes
from parlab.grading.labs.guard import library_calls
from parlab.schemes.zero.stages import Unit, flatten, point_params_into

CFG = LabConfig()  # the lab model, untied, float64: 21 tensors, Psi = 22,688 parameters
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8  # LAMB's learning rate and Adam's constants inside it
# What the parts must not call: the library's offload, its formulas, its ZeRO steps (adam_step, the flat layout),
# its lesson and its runs, and this lab's checks (the judge's accounting and its own placement runs). The pieces
# handed out (Memory, Link, Lamb, in this file) stay allowed.
LIBRARY = (
    "schemes/zero/offload.py",
    "schemes/zero/theory.py",
    "schemes/zero/stages.py",
    "lessons/offload.py",
    "runs/offload.py",
    "grading/labs/lab06_offload.py",
)

# -------------------------------------------------------------------------------------------- the emulated rank


class Memory:
    """One memory of an emulated rank, "device" or "host". zeros(n) allocates [n] numbers in it (float64 unless
    told); a slice of such a tensor is in the same memory. nbytes(): the bytes it holds, counted from its tensors;
    peak: the most it held at once.
    The device is this rank's device (parlab.device()), the host the CPU's memory."""

    def __init__(self, name: str):
        self.name = name
        self.where = parlab.device() if name == "device" else torch.device("cpu")
        self.tensors: list[torch.Tensor] = []
        self.peak = 0  # the most bytes it ever held at once

    def zeros(self, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A new tensor [n] of zeros in this memory (float64 unless told); it counts as held from now on."""
        t = torch.zeros(int(n), dtype=dtype, device=self.where)  # host: a "host" Memory is the CPU's, by design
        self.tensors.append(t)
        self.peak = max(self.peak, self.nbytes())
        return t

    def free(self, t: torch.Tensor) -> None:
        self.tensors = [mine for mine in self.tensors if mine is not t]

    def find(self, t) -> list | None:
        """[name, allocation, a, b]: t is elements [a, b) of this memory's allocation number `allocation`."""
        if not isinstance(t, torch.Tensor):
            return None
        ptr = t.untyped_storage().data_ptr()
        for i, mine in enumerate(self.tensors):
            if mine.device == t.device and mine.untyped_storage().data_ptr() == ptr:
                if not t.is_contiguous():
                    raise ValueError(f"a {self.name} tensor must be a contiguous slice ([a:b]) to be copied or stepped")
                a = t.storage_offset() - mine.storage_offset()
                return [self.name, i, a, a + t.numel()]
        return None

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors)


def place_of(t, memories: list[Memory]) -> list | None:
    for memory in memories:
        found = memory.find(t)
        if found is not None:
            return found
    return None


class Copy:
    """A copy in flight on the link. wait() returns once its data has arrived."""

    def __init__(self, link: Link, number: int, future: Future):
        self.link, self.number, self.future = link, number, future

    def wait(self) -> None:
        """Return once the copy's data has arrived (at once if it already has)."""
        self.future.result()
        self.link.log.append({"op": "wait", "copy": self.number})
        self.link.pending.pop(self.number, None)


class Link:
    """The emulated PCIe link of one rank: to_host(src, dst) copies device tensor src into host tensor dst,
    to_device(src, dst) host into device; both return at once with a Copy (call its wait()). One copy engine (a
    background thread) runs the copies one after the other, in the order issued. A copy's bytes are those of its
    device-side tensor: what crosses the link (a dtype conversion happens on the host side)."""

    def __init__(self, device: Memory, host: Memory, log: list):
        self.device, self.host, self.log = device, host, log
        self.engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-engine")
        self.pending: dict[int, Copy] = {}
        self.numbers = itertools.count()

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        """Copy device tensor src into host tensor dst (contiguous slices of one shape), in the background."""
        return self._copy("to_host", src, dst, self.device, self.host)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        """Copy host tensor src into device tensor dst (contiguous slices of one shape), in the background."""
        return self._copy("to_device", src, dst, self.host, self.device)

    def _copy(self, op: str, src, dst, source: Memory, target: Memory) -> Copy:
        where_src, where_dst = source.find(src), target.find(dst)
        if where_src is None:
            raise ValueError(f"{op}: the source is not {source.name} memory")
        if where_dst is None:
            raise ValueError(
                f"{op}: the destination is not {target.name} memory (allocate it with {target.name}.zeros)"
            )
        if src.shape != dst.shape:
            raise ValueError(f"{op}: source {list(src.shape)} and destination {list(dst.shape)} differ in shape")
        on_device = src if op == "to_host" else dst
        number, nbytes = next(self.numbers), on_device.numel() * on_device.element_size()
        self.log.append({"op": op, "copy": number, "src": where_src, "dst": where_dst, "bytes": nbytes})
        copy = Copy(self, number, self.engine.submit(dst.copy_, src))
        self.pending[number] = copy
        return copy

    def finish(self) -> None:
        """After the student's code returned: log how many copies it left unwaited, then wait for them."""
        left = list(self.pending.values())
        self.log.append({"op": "returned", "pending": len(left)})
        for copy in left:
            copy.future.result()
        self.pending = {}

    def close(self) -> None:
        self.engine.shutdown(wait=True)


def direction(m: torch.Tensor, v: torch.Tensor, t: int) -> torch.Tensor:
    """Adam's direction u = m_hat / (sqrt(v_hat) + eps) after step t's moments: a new tensor [n] (m, v: [n]).
    Where m = v = 0 (the padding) u = 0."""
    b1, b2 = BETAS
    return (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + EPS)


def moments_(grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """Adam's moments, in place: m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2 (torch.optim.Adam's arithmetic)."""
    b1, b2 = BETAS
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)


def trust_ratio(w_norm, u_norm) -> float:
    """LAMB's trust ratio ||w|| / ||u|| of one whole tensor (1 when either norm is 0, as in You et al. 2019)."""
    w_norm, u_norm = float(w_norm), float(u_norm)
    return w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0


def lamb_reference_step(param: torch.Tensor, grad: torch.Tensor, m, v, t: int) -> float:
    """LAMB (You et al. 2019, no weight decay) on ONE WHOLE tensor, in place: the moments, Adam's direction u, and
    p <- p - lr ||p|| / ||u|| u. Returns the trust ratio it used. (The judge's one-device reference.)"""
    moments_(grad, m, v)
    u = direction(m, v, t)
    ratio = trust_ratio(param.norm(), u.norm())
    param.sub_(LR * ratio * u)
    return ratio


class Lamb:
    """LAMB's pieces for a rank's slices, handed out to the student, each logged with the place of its tensors:

    moments(grad, m, v, t)         Adam's moments of step t, in place on m and v [n] (grad [n] read)
    direction(m, v, t) -> u        Adam's direction m_hat / (sqrt(v_hat) + eps): a new tensor [n], not logged
    update(master, m, v, t, ratio) master <- master - lr * ratio * direction(m, v, t), in place

    LAMB's step of a whole tensor W is moments, then W <- W - lr * ratio * u with ratio = ||W|| / ||u|| over the
    WHOLE tensor (1 when either norm is 0). Which ratio to pass is yours to compute."""

    def __init__(self, device: Memory, host: Memory, log: list):
        self.device, self.host, self.log = device, host, log

    def _places(self, **tensors) -> dict:
        return {name: place_of(x, [self.device, self.host]) for name, x in tensors.items()}

    def moments(self, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int) -> None:
        """Adam's moments of step t, in place: m <- b1 m + (1 - b1) grad, v <- b2 v + (1 - b2) grad^2 ([n] each)."""
        self.log.append({"op": "moments", "t": int(t), **self._places(grad=grad, m=m, v=v)})
        moments_(grad, m, v)

    def direction(self, m: torch.Tensor, v: torch.Tensor, t: int) -> torch.Tensor:
        """Adam's direction after step t's moments, m_hat / (sqrt(v_hat) + eps): a new tensor [n] (0 where m = v = 0)"""
        return direction(m, v, t)

    def update(self, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, ratio) -> None:
        """master <- master - lr * ratio * direction(m, v, t), in place ([n] each; ratio: a number)."""
        ratio = float(ratio)
        self.log.append({"op": "update", "t": int(t), "ratio": ratio, **self._places(master=master, m=m, v=v)})
        master.sub_(LR * ratio * direction(m, v, t))


# ------------------------------------------------------------------------------------ ZeRO-2, one unit per tensor


def tensor_units(model: torch.nn.Module, N: int) -> list[Unit]:
    """One unit per parameter tensor, in model order: Psi_u its numel, S_u = ceil(Psi_u / N), padded to N S_u."""
    units, offset = [], 0
    for name, p in model.named_parameters():
        S = math.ceil(p.numel() / N)
        units.append(Unit(name, None, [name], [p], p.numel(), S, offset))
        offset += S
    return units


def unit_numels(cfg: LabConfig = CFG) -> list[int]:
    """Psi_u of every unit (tensor) of the lab model, in model order."""
    return [p.numel() for p in build_lab_model(cfg).parameters()]


def zero2_model(device: Memory, N: int, dtype: torch.dtype = torch.float64):
    """The lab model with each tensor a view of a flat device buffer [N*S_u] (all N slices: ZeRO-2's compute copy),
    in `dtype` (the compute copy's)."""
    model = build_lab_model(CFG, seed=0).to(device.where)  # the same weights on every rank
    units = tensor_units(model, N)
    for u in units:
        u.flat = device.zeros(N * u.shard_numel, dtype)  # [N*S_u]
        u.flat.copy_(flatten(u.params, N * u.shard_numel))
        point_params_into(u)
    return model, units


def rows_of(x: torch.Tensor, r: int, N: int) -> torch.Tensor:
    """Rank r's rows of the global batch [B, T] (B divisible by N), on its device."""
    b = len(x) // N
    return x[r * b : (r + 1) * b].to(parlab.device())


def backward_and_reduce(model, units, x, y, grads: list[torch.Tensor]) -> float:
    """Forward and backward on this rank's rows; per unit, reduce-scatter the flat gradient and divide by N, so
    grads[k] [S_u] holds the mean over ranks of rank r's slice of unit k's gradient. Returns the loss."""
    N, r = dist.get_world_size(), dist.get_rank()
    model.zero_grad(set_to_none=True)
    loss = lab_loss(model(rows_of(x, r, N)), rows_of(y, r, N))  # the mean over this rank's B/N rows
    loss.backward()
    for u, g in zip(units, grads, strict=True):
        flat = flatten([p.grad for p in u.params], N * u.shard_numel)  # [N*S_u] this rank's full gradient
        comm.reduce_scatter_tensor(g, flat)  # [S_u] the sum over ranks of slice r
        g /= N
    return loss.item()


def gather_params(units) -> None:
    """Every rank's updated slices -> every unit's full parameters on every rank (ZeRO-2's all-gather)."""
    r = dist.get_rank()
    for u in units:
        comm.all_gather_into_tensor(u.flat, u.shard_of(u.flat, r).clone())


def train_host_step(init_state, step, batches, staging: int) -> dict:
    """Rank code of the serial and overlap checks: ZeRO-2 of the lab model with LAMB, your init_state (given the
    staging area's size in numbers) and your step. Only your two functions run under the library guard and the
    process-group probe."""
    N, r = dist.get_world_size(), dist.get_rank()
    device, host, log = Memory("device"), Memory("host"), []
    model, units = zero2_model(device, N)  # device allocations 0..U-1: the units' flat parameters
    params = [u.shard_of(u.flat, r) for u in units]  # [S_u] each: rank r's slices of the device parameters
    grads = [device.zeros(u.shard_numel) for u in units]  # device allocations U..2U-1: gradient shards [S_u]
    link, lamb = Link(device, host, log), Lamb(device, host, log)
    called, collectives = [], []  # library calls; per step, the process-group calls of your step
    try:
        log.append({"op": "init"})
        with library_calls(LIBRARY) as seen:
            state = init_state(params, host, link, staging)
        called += seen
        link.finish()
        for t, (x, y) in enumerate(batches, start=1):
            backward_and_reduce(model, units, x, y, grads)
            log.append({"op": "step", "t": t})
            with library_calls(LIBRARY) as seen, probe.recording(keep_sent_data=False) as calls:
                step(params, grads, state, link, lamb, t)
            called += seen
            collectives.append([{"op": c["op"], "bytes": c["bytes"]} for c in calls])
            link.finish()
            gather_params(units)
    finally:
        link.close()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "log": log,
        "host_bytes": host.peak,  # the most it held at any moment
        "shards": [u.shard_numel for u in units],
        "names": [u.name for u in units],
        "collectives": collectives,
        "library": called,
    }
