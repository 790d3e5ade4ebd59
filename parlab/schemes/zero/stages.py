"""ZeRO (Rajbhandari et al. 2020): data parallelism without N copies of the training state.

Notation (lesson 05, the paper's): N data-parallel ranks, Psi parameters, K bytes of optimizer state per
parameter. With mixed precision a rank holds, per parameter: a 2-byte compute copy (bf16/fp16), a 2-byte
gradient, and K = 12 bytes of fp32 master weight, Adam m and Adam v. Plain DP holds all of it on every rank:

    DP       (2 + 2 + K) Psi            every rank: the same params, grads, master, m, v
    stage 1  2 Psi + 2 Psi + K Psi/N    optimizer states sharded (P_os)
    stage 2  2 Psi + (2 + K) Psi/N      ... and gradients (P_os+g)
    stage 3  (2 + 2 + K) Psi / N        ... and parameters (P_os+g+p)

The flat layout. The model is cut into units (one per layer: wte, wpe, blocks.0, ..., ln_f, lm_head). A unit's
parameters, side by side, form a flat buffer of Psi_u numbers, padded with zeros to N * S_u (S_u = ceil(Psi_u/N));
rank r owns elements [r*S_u, (r+1)*S_u) of every unit: its shard. Rank r's flat shard is the concatenation of its
pieces of all units ([S], S = sum S_u); its master weights, m and v are [S] tensors, and Adam runs on them as one.

One step, stage by stage (the collectives are all below, through parlab.core.comm):
  stage 1  forward, backward as in DP (full gradients); per unit: reduce-scatter the flat gradient so rank r gets
           the sum of shard r; / N; Adam on the shard; all-gather the updated shards into the flat parameters.
  stage 2  the same, but each unit's reduce-scatter starts DURING backward (a post-accumulate-grad hook notices
           the unit's last gradient) and the full gradients are dropped at once: a rank keeps only its shard.
  stage 3  also the parameters: between uses a rank holds only its parameter shard; a forward pre-hook
           all-gathers the unit's parameters just before its forward, a forward hook frees them, a hook on the
           unit's output gathers them again just before its backward, and they are freed once its gradients are
           reduce-scattered. prefetch=True starts the all-gather of the next unit one unit early.

Communication per step, per rank (ring algorithms): reduce-scatter (N-1)/N x grad bytes, all-gather (N-1)/N x param
bytes: together one DP all-reduce, 2(N-1)/N Psi. Stage 3 gathers the parameters twice: 3(N-1)/N Psi, 1.5x.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parlab.core import comm
from parlab.core.memory import MemoryLedger, tensor_bytes
from parlab.core.models import lm_loss
from parlab.schemes.data_parallel import shard_batch

STAGES = (1, 2, 3)

# What each backend can reduce (sum), of the dtypes parlab offers; gloo refuses the float8 types, for example
# ("Invalid scalar type").
REDUCIBLE = {
    "gloo": {torch.float64, torch.float32, torch.bfloat16, torch.float16},
    "nccl": {torch.float64, torch.float32, torch.bfloat16, torch.float16},
}


def check_reducible(dtype: torch.dtype, backend: str = "gloo") -> None:
    """A clear ValueError, before any process starts, for gradients the backend cannot reduce-scatter."""
    if dtype not in REDUCIBLE.get(backend, set()):
        names = sorted(str(d).removeprefix("torch.") for d in REDUCIBLE.get(backend, set()))
        raise ValueError(f"the {backend} backend cannot reduce {str(dtype).removeprefix('torch.')}; use one of {names}")


# ----------------------------------------------------------------------------------------- the flat layout


@dataclass
class Unit:
    """A layer whose parameters travel together: one flat buffer of Psi_u numbers, padded to N x S_u."""

    name: str
    module: nn.Module
    names: list[str]  # the parameters' names in the model
    params: list[nn.Parameter]
    numel: int  # Psi_u
    shard_numel: int  # S_u = ceil(Psi_u / N): rank r owns flat elements [r*S_u, (r+1)*S_u)
    offset: int  # where this unit's piece starts in the rank's flat shard [S]
    flat: torch.Tensor | None = None  # [N*S_u] the full parameters (stage 3: storage freed between uses)
    grad_flat: torch.Tensor | None = None  # [N*S_u] stage 1: the full gradients (the .grad are views of it)
    gather_work: object | None = None  # stage 3: an all-gather in flight (prefetch)
    ready: set[int] = field(default_factory=set)  # stages 2, 3: parameters whose gradient arrived
    reduce_work: tuple | None = None  # stages 2, 3: (work, flat gradient, shard out) of its reduce-scatter

    def shard_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s slice of this unit's flat buffer [N*S_u] -> [S_u] (a view)."""
        return flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]


def plan_units(model: nn.Module, world_size: int) -> list[Unit]:
    """One unit per layer (children in order; ModuleLists expanded), with its shard size and padding."""
    N = world_size
    total = sum(p.numel() for p in model.parameters())
    if N > total:
        raise ValueError(f"N={N} ranks is more than the {total} parameters: some shards would be empty")
    layers = []  # (name, module): the model's children in order, a ModuleList's children one by one
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            layers += [(f"{name}.{k}", c) for k, c in child.named_children()]
        else:
            layers.append((name, child))
    units, seen, offset = [], set(), 0
    for name, module in layers:
        named = [(f"{name}.{n}", p) for n, p in module.named_parameters() if id(p) not in seen]
        if not named:
            continue
        seen.update(id(p) for _, p in named)
        numel = sum(p.numel() for _, p in named)
        S = math.ceil(numel / N)
        units.append(Unit(name, module, [n for n, _ in named], [p for _, p in named], numel, S, offset))
        offset += S
    return units


def flatten(tensors: list[torch.Tensor], padded: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensors side by side, zero-padded: [padded]."""
    flat = torch.zeros(padded, dtype=dtype or tensors[0].dtype, device=tensors[0].device)
    flat[: sum(t.numel() for t in tensors)] = torch.cat([t.detach().reshape(-1) for t in tensors])
    return flat


def point_params_into(unit: Unit) -> None:
    """Make the unit's parameters views of its flat buffer (writing the flat buffer writes the parameters)."""
    offset = 0
    for p in unit.params:
        p.data = unit.flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def gather_master(master: torch.Tensor, units: list[Unit], group=None) -> dict[str, torch.Tensor]:
    """Every parameter, by name, from all ranks' flat master shards [S] (an all-gather; for checks)."""
    N = comm.group_size(group)
    full = torch.empty(N * len(master), dtype=master.dtype, device=master.device)
    comm.all_gather_into_tensor(full, master, group=group, label="check: gather master")
    pieces, out = full.view(N, -1), {}  # row q: rank q's flat shard [S]
    for u in units:
        flat = pieces[:, u.offset : u.offset + u.shard_numel].reshape(-1)  # [N*S_u] the unit's flat buffer
        offset = 0
        for name, p in zip(u.names, u.params, strict=True):
            out[name] = flat[offset : offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
    return out


# -------------------------------------------------------------------------------- Adam, by hand, on a flat shard


def adam_step(param, grad, m, v, step: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
    """torch.optim.Adam's update (no weight decay), in place, on flat tensors [S] (rank r's shard).

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  p <- p - lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps)
    """
    b1, b2 = betas
    m.lerp_(grad, 1 - b1)  # the first moment (same arithmetic as torch's Adam)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)  # the second moment
    step_size = lr / (1 - b1**step)
    denom = (v.sqrt() / (1 - b2**step) ** 0.5).add_(eps)
    param.addcdiv_(m, denom, value=-step_size)


# ------------------------------------------------------------------------------------------------------ ZeRO


class ReduceScatterGrads:
    """The gradient path of ZeRO stages 2 and 3 (and of offload, parlab/schemes/zero/offload.py): as soon as backward
    has produced every gradient of a unit, flatten them [N*S_u], drop the full .grad, and reduce-scatter so that rank r
    keeps only the sum of shard r [S_u]. At most one more unit's flat gradients stay in flight (a bounded buffer, as
    DeepSpeed's bucket).

    accumulate=False (one backward per step): units finish last to first on every rank, so they are reduced in that
    order, each once, straight into its slot of rank r's gradient shard. accumulate=True (m micro-batches per step:
    a pipeline, parlab/schemes/hybrid/stage.py): a unit is reduced each time its gradients are complete, in the order
    they complete (the same on every rank: the same schedule runs on all), into a piece that is added to its slot
    when it arrives: m reduce-scatters per step, the price of never holding more than a unit or two of full
    gradients (DeepSpeed's ZeRO-2 pays the same under gradient accumulation).

    A class using it sets self.units, self.unit_of ({id(param): unit}), self.to_reduce (= len(units) - 1),
    self.in_flight (= []), self.group and self.N, registers `_grad_ready` as each parameter's post-accumulate-grad
    hook, and defines `_grad_out(u)` (shard r's slot [S_u]); `_flattened`, `_reduced` and `_arrived` are its
    optional steps. After the last backward of a step it calls `finish_backward()`.
    """

    accumulate = False

    def _grad_ready(self, param: torch.Tensor) -> None:
        u = self.unit_of[id(param)]
        u.ready.add(id(param))
        if not self.accumulate:
            self._reduce_ready_units()
        elif len(u.ready) == len(u.params):
            self._reduce_unit(u)

    def _reduce_ready_units(self, force: bool = False) -> None:
        """Reduce the units whose gradients are complete, last to first; force: every unit left (a parameter that
        got no gradient counts as zero)."""
        if self.accumulate:  # units are reduced as they complete; forced: any with a gradient not yet reduced
            for u in self.units if force else ():
                if any(p.grad is not None for p in u.params):
                    self._reduce_unit(u)
            return
        while self.to_reduce >= 0:
            u = self.units[self.to_reduce]
            if not force and len(u.ready) < len(u.params):
                return
            self._reduce_unit(u)
            self.to_reduce -= 1

    def _reduce_unit(self, u: Unit) -> None:
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in u.params]
        flat = flatten(grads, self.N * u.shard_numel)  # [N*S_u] this rank's full gradients of the unit
        out = self._grad_out(u)  # [S_u] shard r's slot
        if self.accumulate:
            out = torch.empty_like(out)  # this micro-batch's sum of shard r, added to the slot when it arrives
        self._flattened(u, flat, out)
        for p in u.params:
            p.grad = None  # the full gradients are dropped: only the shard survives
        work = comm.reduce_scatter_tensor(out, flat, group=self.group, async_op=True, label=f"grads {u.name}")
        u.reduce_work, u.ready = (work, flat, out), set()
        self.in_flight.append(u)
        self._reduced(u)
        self._finish_reduces(keep=1)  # at most one more unit's full gradients in flight

    def _finish_reduces(self, keep: int = 0) -> None:
        """Wait for the oldest reduce-scatters in flight until `keep` remain; their flat gradients are freed."""
        while len(self.in_flight) > keep:
            u = self.in_flight.pop(0)
            work, _flat, out = u.reduce_work
            work.wait()
            u.reduce_work = None
            self._arrived(u, out)

    def finish_backward(self) -> None:
        """After the step's last backward: reduce every unit not reduced yet (a parameter with no gradient counts as
        zero) and wait for every reduce-scatter in flight; the next backward starts from the last unit again."""
        self._reduce_ready_units(force=True)
        self._finish_reduces()
        self.to_reduce = len(self.units) - 1

    def _grad_out(self, u: Unit) -> torch.Tensor:
        raise NotImplementedError

    def _flattened(self, u: Unit, flat: torch.Tensor, out: torch.Tensor) -> None:
        """Called between flattening a unit's gradients and dropping them (the moment memory peaks)."""

    def _reduced(self, u: Unit) -> None:
        """Called once the unit's reduce-scatter is issued."""

    def _arrived(self, u: Unit, out: torch.Tensor) -> None:
        """Called once the unit's reduced shard `out` [S_u] has arrived: accumulated, it is added to its slot."""
        if self.accumulate:
            self._grad_out(u).add_(out)


class ZeRO(ReduceScatterGrads):
    """ZeRO stage 1, 2 or 3 over `group` (the data-parallel ranks; default all), with Adam.

        zero = ZeRO(model, stage=2, lr=1e-3, compute_dtype=torch.bfloat16)   # the same model on every rank
        zero.zero_grad()
        loss = zero.scale(lm_loss(model(x_r), y_r)); loss.backward()          # hooks work during backward
        zero.step()                                                            # reduce-scatter, Adam, all-gather

    model: the full model in the master dtype (float32 for mixed precision; float64 where exactness is the lesson).
    compute_dtype: the dtype of the parameters and gradients the model computes with (default: the model's).
    loss_scale: multiply the loss by this before backward and divide the gradients after (fp16 needs it; it halves
    on overflow and that step is skipped). The master weights, m and v stay in the model's dtype.
    """

    def __init__(
        self,
        model,
        stage,
        *,
        lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        compute_dtype=None,
        loss_scale=None,
        prefetch=False,
        group=None,
    ):
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r} must be one of {STAGES}")
        self.model, self.stage, self.group, self.prefetch = model, stage, group, prefetch
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0
        self.N, self.rank = comm.group_size(group), comm.group_rank(group)
        self.master_dtype = next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        self.loss_scale = loss_scale
        self.units = plan_units(model, self.N)
        N, r = self.N, self.rank
        S = sum(u.shard_numel for u in self.units)  # rank r's flat shard: its piece of every unit
        # The optimizer states of rank r's shard only: the master weights, Adam m and v, [S] each (K bytes/param).
        self.master = torch.cat([u.shard_of(flatten(u.params, N * u.shard_numel), r) for u in self.units])
        self.m, self.v = torch.zeros_like(self.master), torch.zeros_like(self.master)
        # The compute copy: each unit's parameters become views of a flat buffer [N*S_u] in the compute dtype.
        for u in self.units:
            u.flat = flatten(u.params, N * u.shard_numel, self.compute_dtype)
            point_params_into(u)
        self.ledger, self.hooks = MemoryLedger(), []
        self.grad_shard = None  # stages 2, 3: rank r's gradient shard [S], the only gradient it keeps
        if stage == 1:
            for u in self.units:  # the .grad of each parameter is a view of its unit's flat gradient [N*S_u]
                u.grad_flat = torch.zeros_like(u.flat)
                offset = 0
                for p in u.params:
                    p.grad = u.grad_flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
        else:
            self.grad_shard = torch.zeros(S, dtype=self.compute_dtype, device=self.master.device)
            self.to_reduce = len(self.units) - 1  # units are reduce-scattered last to first, on every rank
            self.in_flight = []  # units whose reduce-scatter is in flight, oldest first
            for u in self.units:
                self.hooks += [p.register_post_accumulate_grad_hook(self._grad_ready) for p in u.params]
            self.unit_of = {id(p): u for u in self.units for p in u.params}
        if stage == 3:
            self.param_shard = torch.cat([u.shard_of(u.flat, r).clone() for u in self.units])  # [S] persistent
            for k, u in enumerate(self.units):
                self._free(u)
                self.hooks.append(u.module.register_forward_pre_hook(lambda mod, args, k=k: self._before_forward(k)))
                self.hooks.append(
                    u.module.register_forward_hook(lambda mod, args, out, k=k: self._after_forward(k, out))
                )

    # -- stage 3: gather a unit's parameters just before they are needed, free them after ---------------------

    def _gather(self, k: int, why: str, wait: bool = True) -> None:
        """All-gather unit k's parameters into its flat buffer [N*S_u] (all ranks' shards side by side)."""
        u = self.units[k]
        if u.gather_work is None and u.flat.untyped_storage().nbytes() == 0:
            u.flat.untyped_storage().resize_(u.flat.numel() * u.flat.element_size())  # allocate again
            shard = self.param_shard[u.offset : u.offset + u.shard_numel]  # [S_u] rank r's parameters
            u.gather_work = comm.all_gather_into_tensor(
                u.flat, shard, group=self.group, async_op=True, label=f"{why} {u.name}"
            )
            self.record(f"gathered {u.name}")
        if wait and u.gather_work is not None:
            u.gather_work.wait()
            u.gather_work = None

    def _free(self, u: Unit) -> None:
        u.flat.untyped_storage().resize_(0)  # the parameters' storage (and every view of it) is gone

    def _before_forward(self, k: int) -> None:
        self._gather(k, "gather")
        if self.prefetch and k + 1 < len(self.units):
            self._gather(k + 1, "prefetch", wait=False)  # the next layer's all-gather overlaps this forward

    def _after_forward(self, k: int, out: torch.Tensor) -> None:
        self._free(self.units[k])
        if torch.is_grad_enabled() and out.requires_grad:  # gather again when backward reaches this unit
            out.register_hook(lambda grad, k=k: self._before_backward(k))

    def _before_backward(self, k: int) -> None:
        self._gather(k, "gather (bwd)")
        if self.prefetch and k > 0:
            self._gather(k - 1, "prefetch (bwd)", wait=False)

    # -- stages 2, 3: reduce-scatter each unit's gradients as soon as backward has produced them (ReduceScatterGrads)

    def _grad_out(self, u: Unit) -> torch.Tensor:
        return self.grad_shard[u.offset : u.offset + u.shard_numel]  # [S_u] <- sum over ranks of shard r

    def _reduced(self, u: Unit) -> None:
        self.record(f"reduce-scatter {u.name}")
        if self.stage == 3:
            self._free(u)  # its backward is done: drop the gathered parameters

    # -- the step ---------------------------------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: times loss_scale (fp16), else unchanged."""
        return loss * self.loss_scale if self.loss_scale else loss

    def zero_grad(self) -> None:
        if self.stage == 1:
            for u in self.units:
                u.grad_flat.zero_()
        elif self.accumulate:  # the micro-batches' pieces are added to the shard: start each step from zero
            self.grad_shard.zero_()

    def step(self, step: int = 0) -> bool:
        """Reduce-scatter the gradients (stage 1; stages 2, 3: wait for the ones in flight), Adam on this rank's
        shard, all-gather the parameters (stages 1, 2). Returns False if the step was skipped (fp16 overflow)."""
        N, r = self.N, self.rank
        if self.stage == 1:
            grad_shard = []
            for u in self.units:  # rank r's shard of the unit's gradient <- sum over ranks, in place
                mine = u.shard_of(u.grad_flat, r)
                comm.reduce_scatter_tensor(mine, u.grad_flat, group=self.group, label=f"grads {u.name}")
                grad_shard.append(mine)
            grad = torch.cat(grad_shard).to(self.master_dtype)  # [S]
        else:
            self.finish_backward()  # units with an unused parameter (zero gradient); every reduce-scatter arrived
            grad = self.grad_shard.to(self.master_dtype)  # [S]
        self.record("before the optimizer step")
        grad.div_(N * (self.loss_scale or 1))  # sum over ranks -> mean; undo the loss scale
        if self.loss_scale:  # fp16: any overflow on any rank skips the step on every rank
            bad = torch.tensor([float(not torch.isfinite(grad).all())], dtype=self.master_dtype, device=grad.device)
            comm.all_reduce(bad, group=self.group, label="overflow?")
            if bad.item() > 0:
                self.loss_scale /= 2
                return False
        self.t += 1
        with comm.span("Adam on the shard", kind="optimizer", step=step):
            adam_step(self.master, grad, self.m, self.v, self.t, self.lr, self.betas, self.eps)
        new = self.master.to(self.compute_dtype)  # [S] the updated compute copy of rank r's shard
        if self.stage == 3:
            self.param_shard.copy_(new)  # gathered again at the next forward
            return True
        for u in self.units:  # every rank's updated shard -> the full flat parameters, in place
            mine = u.shard_of(u.flat, r)
            mine.copy_(new[u.offset : u.offset + u.shard_numel])
            comm.all_gather_into_tensor(u.flat, mine, group=self.group, label=f"params {u.name}")
        return True

    # -- what a rank holds ------------------------------------------------------------------------------------

    def held(self) -> dict[str, int]:
        """Bytes this rank holds now, counted from its tensors (parlab.core.memory.tensor_bytes)."""
        live_grads = [p.grad for u in self.units for p in u.params if p.grad is not None]
        in_flight = [u.reduce_work[1] for u in self.units if u.reduce_work is not None]
        if self.stage == 3:
            params, gathered = tensor_bytes(self.param_shard), tensor_bytes([u.flat for u in self.units])
        else:
            params, gathered = tensor_bytes([u.flat for u in self.units]), 0
        grads = tensor_bytes([u.grad_flat for u in self.units]) if self.stage == 1 else tensor_bytes(self.grad_shard)
        return {
            "params": params,
            "grads": grads,
            "optimizer": tensor_bytes(self.master, self.m, self.v),
            "gathered params": gathered,  # stage 3: full layers gathered for a forward or backward
            "grad buckets": 0 if self.stage == 1 else tensor_bytes(live_grads, in_flight),  # full grads in flight
        }

    def record(self, label: str) -> None:
        """A snapshot of what this rank holds now, in the memory ledger."""
        self.ledger.record(label, **self.held())

    def padding(self) -> int:
        """Zeros added so that every unit splits into N equal shards: sum over units of N*S_u - Psi_u."""
        return sum(self.N * u.shard_numel - u.numel for u in self.units)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter in the master dtype, gathered from all ranks' master shards (for checks)."""
        return gather_master(self.master, self.units, self.group)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


# ---------------------------------------------------------------------------------------- the training loop


def train_zero(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    stage: int,
    lr: float = 1e-3,
    compute_dtype: torch.dtype | None = None,
    loss_scale: float | None = None,
    prefetch: bool = False,
    group=None,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """Rank code: train `model` (the same full model on every rank of `group`) with ZeRO `stage` and Adam.

    batches: the GLOBAL batches [B, T], the same list on every rank; rank r trains on its b = B/N rows.
    Returns this rank's losses, the final parameters (master dtype, gathered for the check), the memory it held
    (snapshots, the steady state before the optimizer step, the peak), the padding and the units.
    """
    N, rank = comm.group_size(group), comm.group_rank(group)
    loss_fn = loss_fn or (lambda model, x, y: lm_loss(model(x), y))
    zero = ZeRO(model, stage, lr=lr, compute_dtype=compute_dtype, loss_scale=loss_scale, prefetch=prefetch, group=group)
    losses, skipped = [], 0
    for step, (x, y) in enumerate(batches):
        x_r, y_r = shard_batch(x, y, rank, N)  # [b, T] each
        zero.zero_grad()
        with comm.span("forward", kind="forward", step=step):
            loss = loss_fn(model, x_r, y_r)
        with comm.span("backward", kind="backward", step=step):
            zero.scale(loss).backward()  # stages 2, 3: reduce-scatters start in here
        skipped += not zero.step(step)
        zero.record("after the step")
        losses.append(loss.item())
        comm.progress(step + 1, len(batches))
    steady = next(row for row in reversed(zero.ledger.rows) if row["label"] == "before the optimizer step")
    peak = {k: max(row[k] for row in zero.ledger.rows) for k in zero.held()}
    out = {
        "losses": losses,
        "skipped_steps": skipped,
        "params": zero.full_params(),
        "steady": {k: v for k, v in steady.items() if k != "label"},
        "peak": {**peak, "total": zero.ledger.peak()["total"]},
        "ledger": zero.ledger.rows,
        "padding": zero.padding(),
        "units": [(u.name, u.numel, u.shard_numel) for u in zero.units],
    }
    zero.remove()
    return out


# ------------------------------------------------------------------------------------------------- the theory
