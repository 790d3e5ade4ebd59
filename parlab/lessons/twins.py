"""Lesson 10: from parlab to PyTorch. Each scheme beside its twin (parlab/twins), what DTensor hides, and the
debugging tools a practitioner reaches for.

    by_hand(scheme)           parlab's hand-written core of a scheme, as a Markdown cell (one slide)
    with_torch(scheme)        the PyTorch twin's few lines of API for the same scheme (the next slide)
    run_twin(scheme, ...)     the scheme and its twin in one launch: (results, report), report["twin"] the verdict
    twin_lines(report)        the twin's verdict lines, and its bytes per kind beside parlab's (rank 0)
    placements()              DTensor's placements on live ranks: which redistribution is which collective
    collective_mismatch()     TORCH_DISTRIBUTED_DEBUG=DETAIL and the flight recorder on a mismatched all-reduce
    parlab_hang()             parlab's own diagnosis of a receive nobody sends to
"""

from __future__ import annotations

import inspect
import os
import re

import torch
import torch.distributed as dist
from IPython.display import Markdown

from parlab.core import comm
from parlab.runs.registry import launch_scheme
from parlab.runtime.launcher import launch


def _source(obj, max_lines: int = 30) -> str:
    lines = inspect.getsource(obj).splitlines()
    return "\n".join(lines[:max_lines] + (["    ..."] if len(lines) > max_lines else []))


def _pairs() -> dict:
    """scheme -> (parlab's hand-written core, the twin's code), both live objects (their source is shown)."""
    from parlab.schemes import tensor_parallel
    from parlab.schemes.data_parallel import all_reduce_gradients
    from parlab.schemes.pipeline.executor import run_step
    from parlab.schemes.sequence import ring_attention
    from parlab.schemes.zero.stages import train_zero
    from parlab.twins import pipeline, sequence, tensor
    from parlab.twins.data import train_torch_ddp, train_torch_reference

    return {
        "dp": (all_reduce_gradients, train_torch_ddp),
        "zero": (train_zero, train_torch_reference),
        "tp": (tensor_parallel.RowParallelLinear, tensor.tp_plan),
        "pp": (run_step, pipeline.pp_rank),
        "ring": (ring_attention.ring_attention, sequence.torch_attention),
    }


def _shown(title: str, obj, max_lines: int) -> Markdown:
    return Markdown(f"**{title}** (`{obj.__module__}.{obj.__qualname__}`)\n```python\n{_source(obj, max_lines)}\n```")


# One code listing per cell: on a slide (1280x720) a listing of about 28 lines fits, two one above the other do not.
def by_hand(scheme: str, max_lines: int = 28) -> Markdown:
    """parlab's hand-written core of `scheme` (the source as it is now, cut after `max_lines` lines)."""
    return _shown("parlab, by hand", _pairs()[scheme][0], max_lines)


def with_torch(scheme: str, max_lines: int = 28) -> Markdown:
    """The PyTorch twin's code for `scheme`: what torch's API leaves to write (cut after `max_lines` lines)."""
    return _shown("PyTorch's API", _pairs()[scheme][1], max_lines)


def run_twin(scheme: str, world_size: int = 2, **options):
    """The scheme and its twin, one launch: (results, report); report["twin"] is the twin's verdict."""
    return launch_scheme(scheme, twin=True, world_size=world_size, **options)


def twin_lines(report: dict, rank: int = 0) -> list[str]:
    """The twin's verdict lines, then its payload bytes per kind beside parlab's own, on one rank."""
    twin = report["twin"]
    if "skipped" in twin:
        return [f"{report['scheme']} vs {twin['name']}: SKIPPED: {twin['skipped']}"]
    if "error" in twin:  # it could not run, through parlab's fault (a tensor on the wrong device)
        return [f"{report['scheme']} vs {twin['name']}: FAIL: {twin['error']}"]
    lines = [f"{report['scheme']} vs {twin['name']}:"] + [f"  {line}" for line in twin["verdicts"]]
    if twin["comm"] is not None:
        ours = {k: v for k, v in report["comm"].items() if isinstance(v, list) and len(v) == report["world_size"]}
        kinds = sorted(
            set(ours) & {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv"} | set(twin["comm"])
        )
        lines.append(f"  bytes handed to torch.distributed by rank {rank}:  {'parlab':>10s} {'twin':>10s}")
        for kind in kinds:
            mine, its = ours.get(kind, [0] * 99)[rank], twin["comm"].get(kind, [0] * 99)[rank]
            lines.append(f"    {kind:44s} {mine:>10,} {its:>10,}")
    return lines


# ------------------------------------------------------------------------------------- what DTensor hides


def _placements_rank() -> list[dict]:
    """Rank code: one tensor per rank, redistributed between placements; the collectives each change issued."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from parlab.twins.record import recording

    P, rank, dev = dist.get_world_size(), dist.get_rank(), comm.device()
    mesh = init_device_mesh(dev.type, (P,))  # on this rank's device: "cpu" under gloo
    rows = []

    def change(label, make, target):
        source = make()
        with recording() as events:
            out = source.redistribute(mesh, [target]).to_local()
        ops = ", ".join(f"{e.kind} {e.bytes} B" for e in events) or "none (a local slice or copy)"
        rows.append({"change": label, "collectives": ops, "local shape": list(out.shape)})

    mine = torch.arange(4, dtype=torch.float64, device=dev) + 10 * rank  # this rank's 4 numbers
    change("Partial(sum) -> Replicate", lambda: DTensor.from_local(mine, mesh, [Partial()]), Replicate())
    change("Partial(sum) -> Shard(0)", lambda: DTensor.from_local(mine, mesh, [Partial()]), Shard(0))
    change("Shard(0) -> Replicate", lambda: DTensor.from_local(mine, mesh, [Shard(0)]), Replicate())
    change("Replicate -> Shard(0)", lambda: DTensor.from_local(mine, mesh, [Replicate()]), Shard(0))

    # Where a Partial comes from: a row-parallel matmul. x [2, 4] split by columns, w [4, 3] by rows.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, generator=gen, dtype=torch.float64).to(dev)  # host: the seeded draw, moved
    w = torch.randn(4, 3, generator=gen, dtype=torch.float64).to(dev)  # host: the seeded draw, moved
    with recording() as events:
        y = distribute_tensor(x, mesh, [Shard(1)], src_data_rank=None) @ distribute_tensor(
            w, mesh, [Shard(0)], src_data_rank=None
        )
    rows.append(
        {
            "change": "Shard(1) @ Shard(0) (the matmul)",
            "collectives": ", ".join(e.kind for e in events) or "none",
            "local shape": list(y.to_local().shape),
            "placement": str(y.placements[0]),
        }
    )
    with recording() as events:
        full = y.full_tensor()  # Partial -> Replicate: here the reduction happens
    same = bool(torch.allclose(full, x @ w, atol=1e-12))
    ops = ", ".join(f"{e.kind} {e.bytes} B" for e in events)
    rows.append(
        {"change": "... .full_tensor()", "collectives": ops, "local shape": list(full.shape), "equal to x @ w": same}
    )
    return rows


def placements(world_size: int = 2) -> list[dict]:
    """Rank 0's table: each change of placement and the collective torch issued for it (recorded)."""
    return launch(_placements_rank, world_size, echo=False)[0]


# -------------------------------------------------------------------------------------------- debugging


def _mismatch_rank() -> dict:
    """Rank code: one good all-reduce, then one whose size differs between the ranks (a bug)."""
    import json

    from torch._C._distributed_c10d import _dump_fr_trace_json

    # torch reads both settings when it creates a process group: this rank's default group exists already.
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"  # the flight recorder: the last 64 collectives of each group
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # what TORCH_DISTRIBUTED_DEBUG=DETAIL sets at start-up
    group = dist.new_group(list(range(dist.get_world_size())))  # checked: wrapped in ProcessGroupWrapper
    dev = comm.device()
    dist.all_reduce(torch.ones(4, device=dev), group=group)
    try:  # rank 1 thinks the tensor has 8 numbers
        dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 8, device=dev), group=group)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    entries = json.loads(_dump_fr_trace_json(True, True)).get("entries", [])
    return {"error": error, "recorded": [(e["profiling_name"], e["input_sizes"]) for e in entries]}


def collective_mismatch() -> dict:
    """Two ranks disagree on an all-reduce's size, under TORCH_DISTRIBUTED_DEBUG=DETAIL and the flight recorder.

    Returns what rank 0 saw: the error torch raised (each rank's op and shape, parsed from its text) and the
    collectives its flight recorder holds (DETAIL's own fingerprint all-gathers among them)."""
    out = launch(_mismatch_rank, 2, echo=False, timeout=60)[0]
    found = re.findall(
        r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
        r"OpType=(\w+), TensorShape=\[([\d, ]*)\]",
        out["error"],
    )
    return {
        "detected": out["error"].split(".")[0],
        "ranks": {int(r): f"{op} of shape [{shape}]" for r, op, shape in found},
        "flight_recorder": out["recorded"],
    }


def _lonely_receive() -> None:
    if dist.get_rank() == 1:
        comm.recv(torch.empty(4, device=comm.device()), src=0, label="the message rank 0 never sends")


def parlab_hang(timeout: float = 60.0) -> list[str]:
    """parlab's launch, on a receive nobody sends to: its diagnosis names each rank's traced call (the calls can never
    match, so it stops the ranks after they waited 2 s, long before `timeout`). The lines as printed, without the
    seconds waited (not deterministic)."""
    from parlab.runtime.errors import LaunchTimeout

    try:
        launch(_lonely_receive, 2, echo=False, timeout=timeout)
    except LaunchTimeout as exc:  # CollectiveMismatch is one: a hang diagnosed before the timeout
        text = re.sub(r"the ranks waited [\d.]+ s and were stopped", "the ranks were stopped", str(exc))
        return [re.sub(r" for [\d.]+ s$", "", line) for line in text.splitlines()]
    return ["(no hang?)"]
