"""Twins of the schemes that split the batch: the ring all-reduce, DP, ZeRO and ZeRO-Offload.

    parlab                                   PyTorch
    ring_all_reduce(x)                       dist.all_reduce(x)
    train_data_parallel(model, ...)          DistributedDataParallel(model)
    train_zero(model, stage=1)               DDP + ZeroRedundancyOptimizer(params, optimizer_class=Adam)
    train_zero(model, stage=2 / 3)           fully_shard(block, reshard_after_forward=stage == 3) per block
    train_offload(model, target="cpu")       fully_shard(..., offload_policy=CPUOffloadPolicy())

DP and ZeRO already train PyTorch's version inside their rank code (parlab/runs/data_parallel.py and zero.py call
`train_torch_ddp` and `train_torch_reference` here); their twins reuse it when it ran (`reused`: its traffic was not
recorded) and run it, recorded, when it did not.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from parlab.core import comm
from parlab.core.check import Verdict, compare, host_values
from parlab.core.models import build_model, lm_loss, make_batches, make_optimizer
from parlab.schemes.data_parallel import shard_batch
from parlab.twins.twin import Twin

# ---------------------------------------------------------------------------------------- the ring all-reduce


def all_reduce_rank(opts, value: dict) -> dict:
    """dist.all_reduce on the same input the ring summed (rank code)."""
    total = value["input"].clone()
    dist.all_reduce(total)
    return {"sum": total}


def all_reduce_compare(opts, results, outs) -> list[Verdict]:
    return [
        compare(f"parlab's ring, rank {r}", results[r]["ring"], o["sum"], against="dist.all_reduce")
        for r, o in enumerate(outs)
    ]


def world_mesh():
    """A one-axis DeviceMesh of every rank on parlab's device (cuda under NCCL, cpu under gloo), for FSDP2: its
    default mesh takes the accelerator whenever one exists, even in a gloo run whose tensors are on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(comm.device().type, (dist.get_world_size(),))


# ------------------------------------------------------------------------------------------------------ DDP


def train_torch_ddp(opts, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The same training with torch.nn.parallel.DistributedDataParallel, for comparison (rank code).

    DDP talks to torch.distributed itself, so nothing here is traced: the parlab trace shows only our DP."""
    from torch.nn.parallel import DistributedDataParallel

    P, rank, M = comm.group_size(), comm.group_rank(), opts.microbatches
    model = build_model(opts.gpt_config(), opts.seed, device=comm.device())  # where the batches are
    ddp = DistributedDataParallel(model, bucket_cap_mb=opts.bucket_bytes / 2**20)
    opt = make_optimizer(ddp.parameters(), opts.optimizer, opts.lr)
    losses = []
    for x, y in batches:
        x_r, y_r = shard_batch(x, y, rank, P)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for m, (x_m, y_m) in enumerate(zip(x_r.chunk(M), y_r.chunk(M), strict=True)):
            with ddp.no_sync() if m < M - 1 else nullcontext():
                loss = lm_loss(ddp(x_m), y_m) / M
                loss.backward()
            step_loss += loss.item()
        opt.step()
        losses.append(step_loss)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def ddp_rank(opts, value: dict) -> dict:
    """torch DDP on the same data: reused when parlab's dp rank code trained it already (opts.ddp)."""
    if "ddp" in value:
        return {**value["ddp"], "reused": True}
    return train_torch_ddp(
        opts, make_batches(opts.gpt_config(), opts.batch, opts.steps, opts.seed, device=comm.device())
    )


def losses_and_params(opts, results, outs, what: str) -> list[Verdict]:
    """The twin's step losses (mean over ranks) and every rank's final parameters, vs parlab's."""
    P, K, dtype = len(results), opts.steps, opts.gpt_config().torch_dtype
    ours = host_values((sum(r["losses"][k] for r in results) / P for k in range(K)), dtype)
    theirs = host_values((sum(o["losses"][k] for o in outs) / P for k in range(K)), dtype)
    return [
        compare(f"parlab's loss of each of {K} steps", ours, theirs, against=what),
        compare(
            f"parlab's parameters after {K} steps, every rank",
            [r["params"] for r in results],
            [o["params"] for o in outs],
            against=what,
        ),
    ]


def ddp_compare(opts, results, outs) -> list[Verdict]:
    return losses_and_params(opts, results, outs, "torch DDP")


# ----------------------------------------------------------------------------------------------------- ZeRO


def reference_note(opts) -> str:
    """Why no PyTorch implementation is compared (empty when one is)."""
    if opts.mixed_precision and opts.stage == 1:
        return "ZeroRedundancyOptimizer keeps no fp32 master copy of bf16/fp16 parameters: not the same recipe"
    if opts.mixed_precision and opts.grad_dtype() == torch.float16:
        return "FSDP2 has no loss scaling of its own: not the same fp16 recipe"
    return ""


def train_torch_reference(opts, batches) -> dict:
    """Rank code: the same training with PyTorch's sharded optimizers (untraced: they call torch.distributed).

    stage 1: DistributedDataParallel + ZeroRedundancyOptimizer(Adam); stage 2: FSDP2 fully_shard per layer,
    reshard_after_forward=False (parameters stay gathered between forward and backward: ZeRO-2's memory);
    stage 3: fully_shard with reshard_after_forward=True. Mixed precision: FSDP2's MixedPrecisionPolicy."""
    P, rank = comm.group_size(), comm.group_rank()
    model = build_model(opts.gpt_config(), opts.seed, device=comm.device())  # where the batches are
    if opts.stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=opts.lr)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(opts.grad_dtype(), opts.grad_dtype()) if opts.mixed_precision else None
        kwargs = {"reshard_after_forward": opts.stage == 3, **({"mp_policy": mp} if mp else {})}
        # The mesh on parlab's device: left to itself, FSDP2 would pick the GPU even under a gloo (CPU) run.
        kwargs["mesh"] = world_mesh()
        for block in model.blocks:
            fully_shard(block, **kwargs)
        net = fully_shard(model, **kwargs)
        opt = torch.optim.Adam(model.parameters(), lr=opts.lr)
    losses = []
    for x, y in batches:
        x_r, y_r = shard_batch(x, y, rank, P)
        loss = lm_loss(net(x_r), y_r)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in full.items()}}


# ------------------------------------------------------------------------------------------ rank and report


def zero_name(opts) -> str:
    if reference_note(opts):
        return "no PyTorch twin for this recipe"
    return "torch ZeroRedundancyOptimizer + DDP" if opts.stage == 1 else f"torch FSDP2 fully_shard (ZeRO-{opts.stage})"


def zero_skip(opts) -> str:
    return reference_note(opts)


def zero_rank(opts, value: dict) -> dict:
    """ZeroRedundancyOptimizer (stage 1) or fully_shard (2, 3): reused when parlab's zero rank code ran it."""
    if "reference" in value:
        return {**value["reference"], "reused": True}
    return train_torch_reference(
        opts, make_batches(opts.gpt_config(), opts.batch, opts.steps, opts.seed, device=comm.device())
    )


def zero_compare(opts, results, outs) -> list[Verdict]:
    """Ours against PyTorch's: under mixed precision, as the scheme's own report compares them (the loss to bf16's
    rounding, 99% of the parameters to 1e-4: mixed_precision_verdicts), not to float32's 1e-5."""
    if not opts.mixed_precision:
        return losses_and_params(opts, results, outs, zero_name(opts))
    P, K = len(results), opts.steps
    return mixed_precision_verdicts(
        opts,
        [sum(r["losses"][k] for r in results) / P for k in range(K)],
        [sum(o["losses"][k] for o in outs) / P for k in range(K)],
        [r["params"] for r in results],
        [o["params"] for o in outs],
        zero_name(opts),
    )


# Mixed precision against the same recipe (one device, or PyTorch's FSDP2): bf16 keeps ~3 significant digits, so
# the ranks' sum of gradients differs from the reference's in the last bits, and Adam (m / sqrt(v)) turns an element
# whose gradient is ~0 (the attention key biases' exact gradient is 0) into a full step of +-lr either way. So: the
# loss of each step within 4e-2 (bf16's spacing at a loss of ~3.5 is 1.6e-2), and 99% of the parameters within 1e-4
# (measured on the reference GPT: under 1% of the elements move by more).
MIXED_LOSS_TOL, MIXED_PARAM_TOL, MIXED_QUANTILE = 4e-2, 1e-4, 0.99


def mixed_precision_verdicts(opts, loss_ours, loss_ref, params_ours, params_ref, against: str) -> list[Verdict]:
    """The loss of each step and, for each rank, the 99th percentile of |ours - reference| over every parameter
    element, held to the tolerances above. params_*: one {name: tensor} per rank."""
    K = opts.steps
    quantiles = []
    for ours, ref in zip(params_ours, params_ref, strict=True):
        errors = torch.cat([(ours[n].double() - ref[n].double()).abs().reshape(-1) for n in ref])
        quantiles.append(torch.quantile(errors, MIXED_QUANTILE).item())
    dtype = str(opts.grad_dtype()).removeprefix("torch.")
    f64, default = torch.float64, torch.get_default_dtype()
    return [
        compare(
            f"loss of each of {K} steps ({dtype} compute)",
            host_values(loss_ours, f64),
            host_values(loss_ref, f64),
            MIXED_LOSS_TOL,
            against=against,
        ),
        compare(
            f"parameters after {K} steps, {MIXED_QUANTILE:.0%} of the elements ({dtype} compute), every rank",
            host_values(quantiles, default),
            host_values([0.0] * len(quantiles), default),
            MIXED_PARAM_TOL,
            against=against,
        ),
    ]


# ------------------------------------------------------------------------------------------- ZeRO-Offload


def offload_skip(opts) -> str:
    if opts.target == "disk":
        return "FSDP2 offloads to host memory only (CPUOffloadPolicy); torch has no disk (NVMe) offload"
    return ""


def offload_rank(opts, value: dict) -> dict:
    """FSDP2 with its parameters, gradients and Adam state in host memory: the few lines of the API.

    ZeRO-2's recipe (reshard_after_forward=False: parameters stay gathered from forward to backward); on a CPU-only
    machine host and device are the same memory, so what is checked is the arithmetic, not the copies."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    cfg, P, rank, dev = opts.gpt_config(), dist.get_world_size(), dist.get_rank(), comm.device()
    model = build_model(cfg, opts.seed, device=dev)  # FSDP2 moves what it offloads to the host itself
    policy = {"reshard_after_forward": False, "offload_policy": CPUOffloadPolicy(), "mesh": world_mesh()}
    if opts.target == "none":
        policy.pop("offload_policy")
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.Adam(model.parameters(), lr=opts.lr)
    losses = []
    for x, y in make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev):  # the data where the compute is
        x_r, y_r = shard_batch(x, y, rank, P)  # this rank's rows of the global batch, as parlab's ZeRO takes them
        loss = lm_loss(model(x_r), y_r)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()}}


def offload_compare(opts, results, outs) -> list[Verdict]:
    return losses_and_params(opts, results, outs, "torch FSDP2 + CPUOffloadPolicy")


def offload_name(opts) -> str:
    return "torch FSDP2 + CPUOffloadPolicy" if opts.target != "none" else "torch FSDP2 fully_shard (ZeRO-2)"


TWINS = {
    "collectives": Twin("dist.all_reduce", all_reduce_rank, all_reduce_compare),
    "dp": Twin("torch DDP", ddp_rank, ddp_compare),
    "dp-naive": Twin("torch DDP", ddp_rank, ddp_compare),
    "zero": Twin(zero_name, zero_rank, zero_compare, zero_skip),
    "offload": Twin(offload_name, offload_rank, offload_compare, offload_skip),
}
