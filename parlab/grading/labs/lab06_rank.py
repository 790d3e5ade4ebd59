"""Lab 06's emulated rank: its device and host memory (`Memory`), the link between them (`Link`), ZeRO-2's layout
on them, and the rank code of the serial and overlap checks (see lab06_offload.py for what each piece is)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from parlab.core import comm
from parlab.core.memory import tensor_bytes
from parlab.core.models import GPTConfig, build_model, lm_loss
from parlab.schemes.data_parallel import shard_batch
from parlab.schemes.zero.offload import CopyEngine
from parlab.schemes.zero.stages import adam_step, flatten, plan_units, point_params_into

CFG = GPTConfig()  # the reference GPT: 2 blocks, hidden 32, float64: Psi = 30,080 parameters in 6 units
LR = 1e-3  # Adam's learning rate

# -------------------------------------------------------------------------------------------- the emulated rank


class Memory:
    """One memory of an emulated rank, "device" or "host". zeros(n) allocates [n] numbers in it (float64); a view
    of such a tensor (a slice) is in the same memory. nbytes(): the bytes it holds, counted from its tensors."""

    def __init__(self, name: str):
        self.name = name
        self.tensors: list[torch.Tensor] = []

    def zeros(self, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        t = torch.zeros(int(n), dtype=dtype)
        self.tensors.append(t)
        return t

    def free(self, t: torch.Tensor) -> None:
        self.tensors = [mine for mine in self.tensors if mine is not t]

    def find(self, t) -> list | None:
        """[name, allocation, a, b]: t is elements [a, b) of this memory's allocation number `allocation`."""
        if not isinstance(t, torch.Tensor):
            return None
        ptr = t.untyped_storage().data_ptr()
        for i, mine in enumerate(self.tensors):
            if mine.untyped_storage().data_ptr() == ptr:
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

    def __init__(self, link: Link, number: int, future):
        self.link, self.number, self.future = link, number, future

    def wait(self) -> None:
        self.future.result()
        self.link.log.append({"op": "wait", "copy": self.number})
        self.link.pending.pop(self.number, None)


class Link:
    """The emulated PCIe link of one rank: to_host(src, dst) copies device tensor src into host tensor dst,
    to_device(src, dst) host into device; both return at once with a Copy (call its wait()). The copies run one
    after the other, in the order issued, in a background thread (parlab.schemes.zero.offload.CopyEngine)."""

    def __init__(self, device: Memory, host: Memory, log: list):
        self.device, self.host, self.log = device, host, log
        self.engine = CopyEngine(torch.device("cpu"))
        self.pending: dict[int, Copy] = {}
        self.numbers = itertools.count()

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        return self._copy("to_host", src, dst, self.device, self.host)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        return self._copy("to_device", src, dst, self.host, self.device)

    def _copy(self, op: str, src, dst, source: Memory, target: Memory) -> Copy:
        where_src, where_dst = source.find(src), target.find(dst)
        if where_src is None:
            raise ValueError(f"{op}: the source is not {source.name} memory")
        if where_dst is None:
            raise ValueError(f"{op}: the destination is not {target.name} memory (allocate it with host.zeros)")
        if src.shape != dst.shape:
            raise ValueError(f"{op}: source {list(src.shape)} and destination {list(dst.shape)} differ in shape")
        number, nbytes = next(self.numbers), src.numel() * src.element_size()
        self.log.append({"op": op, "copy": number, "src": where_src, "dst": where_dst, "bytes": nbytes})
        future = self.engine.submit(op, "offload" if op == "to_host" else "upload", nbytes, 0, lambda: dst.copy_(src))
        copy = Copy(self, number, future)
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
        self.engine.close()


def logged_adam(device: Memory, host: Memory, log: list):
    def adam(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int) -> None:
        """parlab.schemes.zero.stages.adam_step(master, grad, m, v, t, LR) in place, logged with the place of each
        tensor."""
        places = {
            name: place_of(x, [device, host]) for name, x in [("master", master), ("grad", grad), ("m", m), ("v", v)]
        }
        log.append({"op": "adam", "t": int(t), **places})
        adam_step(master, grad, m, v, t, LR)

    return adam


def zero2_model(device: Memory, N: int):
    """The reference GPT with each unit's parameters views of a flat device buffer [N*S_u] (all N slices)."""
    model = build_model(CFG, seed=0)  # the same weights on every rank
    units = plan_units(model, N)
    for u in units:
        u.flat = device.zeros(N * u.shard_numel)  # [N*S_u]
        u.flat.copy_(flatten(u.params, N * u.shard_numel))
        point_params_into(u)
    return model, units


def backward_and_reduce(model, units, x, y, grads: list[torch.Tensor]) -> float:
    """Forward and backward on this rank's rows; per unit, reduce-scatter the flat gradient and divide by N, so
    grads[k] [S_u] holds the mean over ranks of rank r's slice of unit k's gradient. Returns the loss."""
    N, r = dist.get_world_size(), dist.get_rank()
    model.zero_grad(set_to_none=True)
    x_r, y_r = shard_batch(x, y, r, N)  # [B/N, T]
    loss = lm_loss(model(x_r), y_r)
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


def train_host_step(init_state, step, batches) -> dict:
    """Rank code of the serial and overlap checks: ZeRO-2 with your init_state and your step."""
    N, r = dist.get_world_size(), dist.get_rank()
    device, host, log = Memory("device"), Memory("host"), []
    model, units = zero2_model(device, N)  # device allocations 0..U-1: the units' flat parameters
    params = [u.shard_of(u.flat, r) for u in units]  # [S_u] each: rank r's slices of the device parameters
    grads = [device.zeros(u.shard_numel) for u in units]  # device allocations U..2U-1: gradient shards [S_u]
    link, adam = Link(device, host, log), logged_adam(device, host, log)
    losses = []
    try:
        log.append({"op": "init"})
        state = init_state(params, host, link)
        link.finish()
        for t, (x, y) in enumerate(batches, start=1):
            losses.append(backward_and_reduce(model, units, x, y, grads))
            log.append({"op": "step", "t": t})
            step(params, grads, state, link, adam, t)
            link.finish()
            gather_params(units)
    finally:
        link.close()
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "log": log,
        "host_bytes": host.nbytes(),
        "shards": [u.shard_numel for u in units],
    }
