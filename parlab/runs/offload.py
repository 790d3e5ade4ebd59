"""Run and check offload (parlab/schemes/zero/offload.py): `python -m parlab run offload --target {cpu,disk} --world N`.

The ranks train with ZeRO-2 and Adam, the optimizer state on the host (cpu) or in memory-mapped files (disk), then
the same run without offload (target none: everything on the device). The parent trains one device on the whole
batch (torch.optim.Adam) and compares; it sets the bytes each rank held on the device, the host and the disk
(counted from its tensors and files) beside the formulas, the bytes each copy moved beside theory, and checks that
the disk folder is gone. A device, host or disk budget too small for the run is refused before any process starts.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from parlab.core.check import check_equal, compare
from parlab.core.comm import device
from parlab.core.models import GPT, build_model, make_batches
from parlab.core.scratch import check_folder, new_folder_path, offload_folder, own, release, sweep_orphans
from parlab.core.trace import Trace
from parlab.runs.options import ModelOptions, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import count_checks, mean_losses, one_device_checks, run_report, single_device_run
from parlab.runtime.errors import Results
from parlab.schemes.zero.offload import PLACES, TARGETS, train_offload
from parlab.schemes.zero.stages import plan_units
from parlab.schemes.zero.theory import check_budget, offload_memory

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str | int) -> int:
    """'64KB' -> 64000, '2MiB' -> 2097152, '0' -> 0 (no limit)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match[2].upper() not in _UNITS:
        raise ValueError(f"{text!r} is not a byte count (e.g. 0, 64000, 64KB, 1.5MB, 2GiB)")
    return int(float(match[1]) * _UNITS[match[2].upper()])


@dataclass
class OffloadOptions(ModelOptions):
    target: str = option(
        "cpu",
        "where Adam's state lives: cpu (host memory) or disk (memory-mapped files); none: on the device (ZeRO-2)",
        choices=list(TARGETS),
    )
    device_budget: int = option(0, "device memory per rank, e.g. 64KB (0: no limit)", parse=parse_bytes)
    host_budget: int = option(0, "host memory per rank (0: no limit)", parse=parse_bytes)
    disk_budget: int = option(0, "disk per rank (0: no limit)", parse=parse_bytes)
    folder: str = option(
        "", "disk target: a new or empty folder for the files, removed after the run (default: a new temporary folder)"
    )
    reference: bool = option(True, "also train without offload (target none) and compare (--no-reference skips)")
    optimizer: str = option("adam", "offload steps Adam (written out): adam only", choices=["adam"])
    lr: float = option(1e-3, "learning rate", bounds="(0, 100]")

    def __post_init__(self):
        for name in ("device_budget", "host_budget", "disk_budget"):
            setattr(self, name, parse_bytes(getattr(self, name)))
        if self.target == "disk":
            # The folder is named here, in the parent: the parent removes it after the run (the report), and at
            # exit whatever happened to the ranks (killed ranks run no cleanup of their own), with the folders made
            # to hold it (parlab/core/scratch.py). A folder that holds files already is refused by validate() and
            # never removed.
            self.folder = self.folder or str(new_folder_path())
            try:
                check_folder(self.folder)
            except ValueError:
                return
            own(self.folder)

    def validate(self) -> None:
        super().validate()
        if self.target not in TARGETS:
            raise ValueError(f"target={self.target!r} must be one of {TARGETS}")
        if self.optimizer != "adam":
            raise ValueError(f"optimizer={self.optimizer!r}: offload steps Adam; use adam")
        if self.target != "disk":
            self.no_effect(("folder",), f"with target {self.target!r} (only the disk target writes files)")
        check_folder(self.folder)  # never a folder with someone's files in it: it is removed after the run
        if self.target == "disk":
            sweep_orphans()  # the folders of earlier runs whose parent was killed (CLI or Python, as rendezvous)
        if self.batch % self.world_size:
            raise ValueError(f"global batch={self.batch} is not divisible by world_size={self.world_size}")
        unit_numels = self.unit_numels()
        if self.world_size > sum(unit_numels):
            raise ValueError(f"world_size={self.world_size} is more than the {sum(unit_numels)} parameters")
        check_budget(self.memory()["peak_total"], self.budget(), self.target)

    def budget(self) -> dict[str, int]:
        return {"device": self.device_budget, "host": self.host_budget, "disk": self.disk_budget}

    def unit_numels(self) -> list[int]:
        """Psi_u of each unit of the reference GPT (built on the meta device: nothing allocated)."""
        with torch.device("meta"):
            model = GPT(self.gpt_config())
        return [u.numel for u in plan_units(model, 1)]

    def memory(self) -> dict:
        """The formulas of parlab.schemes.zero.offload for this run: bytes per rank by place, steady and peak."""
        b = self.gpt_config().dtype_bytes
        return offload_memory(self.unit_numels(), self.world_size, self.target, b, b)


def offload_rank(opts: OffloadOptions) -> dict:
    """Rank code: train with the optimizer state on opts.target; then, unless opts.reference is False, the same
    run without offload (its events come after `reference_from` on this rank's clock)."""
    cfg, dev = opts.gpt_config(), device()  # dev: this rank's GPU under NCCL, else the CPU
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)  # global [B, T], the same everywhere
    folder = opts.folder or None
    out = train_offload(build_model(cfg, opts.seed, device=dev), batches, target=opts.target, lr=opts.lr, folder=folder)
    out["reference_from"] = time.perf_counter()
    if opts.reference and opts.target != "none":
        ref = train_offload(build_model(cfg, opts.seed, device=dev), batches, target="none", lr=opts.lr)
        out["none"] = {"losses": ref["losses"], "params": ref["params"]}
    return out


def offload_trace(results: Results) -> Trace:
    """The events of the offload run only (the reference run without offload, if any, came after)."""
    cut = [r["reference_from"] for r in results]
    return Trace([e for e in results.trace.events if e.start < cut[e.rank]], results.trace.world_size)


def offload_theory(opts: OffloadOptions) -> dict:
    """Bytes per rank per step that each copy and collective moves (S: the rank's shard, padded)."""
    cfg = opts.gpt_config()
    N, b, S = opts.world_size, cfg.dtype_bytes, opts.memory()["S"]
    moves = {"reduce_scatter": b * N * S, "all_gather": b * S}  # payload: a unit's flat gradients; my slice
    if opts.target != "none":
        moves.update({"offload": b * S, "upload": b * S})  # gradient shard to the host, parameters back
    if opts.target == "disk":
        moves.update({"disk_read": 3 * b * S, "disk_write": 3 * b * S})  # master, m, v: read and written once
    return moves


def offload_report(opts: OffloadOptions, results: Results) -> dict:
    """One device on the whole batch, the run without offload, the bytes by place and by copy, the folder."""
    P, K, target = opts.world_size, opts.steps, opts.target
    single = single_device_run(opts, optimizer="adam")
    loss_parallel = mean_losses(results, K)
    verdicts = _numerics(opts, results, single, loss_parallel)
    memory_checks, memory_lines = _memory(opts, results)
    moved_checks, moved_lines, trace, moved = _moved(opts, results)
    folder_checks, removed = _folder(opts)
    checks = memory_checks + moved_checks + folder_checks
    memory = opts.memory()
    return run_report(
        f"offload ({target})",
        P,
        verdicts,
        passed=all(c.passed for c in checks),
        comm={
            **trace.bytes_per_rank(),
            "per_step": {k: [n / K for n in v] for k, v in moved.items()},
            "theory_per_step": offload_theory(opts),
        },
        lines=[v.line for v in verdicts] + memory_lines + moved_lines + [c.line for c in folder_checks],
        target=target,
        steps=K,
        bytes_per_rank={
            "steady": {p: [sum(r["steady"][p].values()) for r in results] for p in PLACES},
            "peak": {p: [sum(r["peak"][p].values()) for r in results] for p in PLACES},
            "detail_rank0": {"steady": results[0]["steady"], "peak": results[0]["peak"]},
            "formula": {"steady": memory["steady"], "peak": memory["peak"], "S": memory["S"]},
            "cuda_allocated_peak": [r["cuda_allocated_peak"] for r in results],
        },
        budget=opts.budget(),
        disk_folder=opts.folder or None,
        disk_folder_removed=removed,
        loss_single=single.losses,
        loss_parallel=loss_parallel,
        batch=opts.batch,
    )


def _numerics(opts: OffloadOptions, results: Results, single, loss_parallel: list[float]) -> list:
    """Ours against one device (torch.optim.Adam), and against the same run with the state on the device: where
    Adam's state lives must not change a bit of the result."""
    verdicts = one_device_checks(
        single,
        opts.gpt_config().torch_dtype,
        loss=(f"loss of each of {opts.steps} steps", loss_parallel),
        params=(f"parameters after {opts.steps} steps, every rank", [r["params"] for r in results]),
        ranks=opts.world_size,
    )
    if opts.reference and opts.target != "none":
        verdicts.append(
            compare(
                "parameters vs the same run without offload (target none), every rank",
                [r["params"] for r in results],
                [r["none"]["params"] for r in results],
                against="the run without offload",
            )
        )
    return verdicts


def _memory(opts: OffloadOptions, results: Results) -> tuple[list, list[str]]:
    """Bytes by place: what each rank held before the optimizer step (= formula) and at its peak (<= formula).
    Returns (checks, one line per place and moment)."""
    memory, P = opts.memory(), opts.world_size
    lines, checks = [], []
    for place in PLACES:
        steady = [sum(r["steady"][place].values()) for r in results]
        theory = memory["steady_total"][place]
        checks += [check_equal(f"{place} bytes before the step, rank {r}", steady[r], theory) for r in range(P)]
        lines.append(
            f"{place} bytes before the optimizer step, per rank: measured {steady} = formula {theory:,}: "
            f"{'PASS' if all(n == theory for n in steady) else 'FAIL'}"
        )
        peak, bound = max(sum(r["peak"][place].values()) for r in results), memory["peak_total"][place]
        checks.append(check_equal(f"{place} peak within the formula", peak <= bound, True))
        lines.append(
            f"{place} bytes at the peak, every rank: measured {peak:,} <= formula {bound:,}: "
            f"{'PASS' if peak <= bound else 'FAIL'}"
        )
    return checks, lines


def _moved(opts: OffloadOptions, results: Results) -> tuple[list, list[str], Trace, dict]:
    """Bytes each copy and collective moved per step, per rank, against theory (the final check gather left out).
    Returns (checks, one line per kind, the offload run's trace, the bytes moved by kind and rank)."""
    P, K = opts.world_size, opts.steps
    trace = offload_trace(results)
    moved = {kind: [0] * P for kind in offload_theory(opts)}
    for e in trace.events:
        if e.kind in moved and not e.label.startswith("check:"):
            moved[e.kind][e.rank] += e.bytes
    checks, lines = [], []
    for kind, theory in offload_theory(opts).items():
        per_step = [n / K for n in moved[kind]]
        checks += [check_equal(f"{kind} bytes per step, rank {r}", per_step[r], theory) for r in range(P)]
        lines.append(
            f"{kind} bytes per step, per rank: measured {per_step[0]:g} (every rank: "
            f"{'same' if len(set(per_step)) == 1 else per_step}) = theory {theory:g}: "
            f"{'PASS' if all(n == theory for n in per_step) else 'FAIL'}"
        )
    return checks, lines, trace, moved


def _folder(opts: OffloadOptions) -> tuple[list, bool]:
    """The disk folder: the ranks removed their files; the parent removes the folder, and checks it is gone.
    Returns (checks, whether it is gone)."""
    if not opts.folder:
        return [], True
    files_left = len(list(Path(opts.folder).rglob("*")))  # the ranks are done: their close() ran
    release(opts.folder)  # and the folders made to hold it
    removed = not Path(opts.folder).exists()
    rows = [
        ("files the ranks left in the disk folder", files_left, 0),
        ("disk folder removed after the run", removed, True),
    ]
    return count_checks(rows), removed


def run_offload(world_size: int = 4, target: str = "cpu", **options) -> tuple[Results, dict]:
    """Run offload on live ranks; returns (results, report), the report being what `python -m parlab run offload`
    prints. The disk folder is removed whatever happens (also on an error or Ctrl-C: offload_folder).
    results.trace: the offload run's events only.

    options: any OffloadOptions field (steps, batch, layers, hidden, dtype, lr, device_budget, reference, pace...).
    """
    folder = Path(options.pop("folder", "") or new_folder_path()) if target == "disk" else None
    if folder is None:
        results, report = launch_scheme("offload", world_size=world_size, target=target, **options)
    else:
        with offload_folder(folder):
            results, report = launch_scheme(
                "offload", world_size=world_size, target=target, folder=str(folder), **options
            )
        report["disk_folder_removed"] = not folder.exists()
    return results.derived(list(results), offload_trace(results)), report


SCHEMES = [
    Scheme(
        "offload",
        "ZeRO-2 with Adam's state in host memory (ZeRO-Offload) or on disk (ZeRO-Infinity); vs one device",
        OffloadOptions,
        offload_rank,
        offload_report,
    )
]
