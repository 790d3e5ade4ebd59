"""Run and check the ring all-reduce (parlab/schemes/collectives.py): `python -m parlab run collectives`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parlab.core import comm
from parlab.core.check import compare
from parlab.core.models import dtype_bytes
from parlab.runs.options import RunOptions, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import count_checks, run_report
from parlab.runtime.errors import Results
from parlab.schemes.collectives import ring_all_reduce, ring_theory_bytes


@dataclass
class RingOptions(RunOptions):
    numel: int = option(1024, "elements in the tensor each rank contributes")
    keep_history: bool = option(False, "keep every rank's chunks after each step (for drawing)")

    def validate(self) -> None:
        super().validate()
        if self.numel < self.world_size:
            raise ValueError(f"numel={self.numel} must be >= world_size={self.world_size} (one chunk per rank)")


def ring_rank(opts: RingOptions) -> dict:
    """Rank code: each rank draws its own data, sums it with the ring and with dist.all_reduce."""
    rank = comm.group_rank()
    gen = torch.Generator().manual_seed(opts.seed * 1000 + rank)
    # Drawn on the host with the seeded generator (the same numbers on any machine), then moved to this rank's device:
    # NCCL refuses a CPU tensor.
    x = torch.randn(opts.numel, generator=gen, dtype=getattr(torch, opts.dtype)).to(comm.device())  # host: seeded
    history = [] if opts.keep_history else None
    ring = ring_all_reduce(x, history)
    reference = x.clone()
    torch.distributed.all_reduce(reference)  # untraced on purpose: the trace shows only what the ring sent
    return {"input": x, "ring": ring, "all_reduce": reference, "history": history}


def ring_report(opts: RingOptions, results: Results) -> dict:
    P, numel = opts.world_size, opts.numel
    element_size = dtype_bytes(opts.dtype)
    # The single-device reference: the plain sum of the ranks' inputs, computed here in one process.
    reference = torch.stack([r["input"] for r in results]).sum(dim=0)
    verdicts = [compare(f"ring all-reduce, rank {rank}", r["ring"], reference) for rank, r in enumerate(results)]
    verdicts.append(compare("dist.all_reduce, rank 0", results[0]["all_reduce"], reference))
    comm_bytes = results.trace.bytes_per_rank()
    theory = ring_theory_bytes(numel, element_size, P)
    byte_checks = count_checks(
        [
            (f"bytes sent by rank {rank}", sent, theory[rank])
            for rank, sent in enumerate(comm_bytes.get("send", [0] * P))
        ]
    )
    return run_report(
        "collectives",
        P,
        verdicts + byte_checks,
        comm={**comm_bytes, "theory_bytes_per_rank": theory},
        numel=numel,
        tensor_bytes=numel * element_size,
    )


def run_ring(world_size: int = 4, **options) -> tuple[Results, dict]:
    """Run the ring all-reduce on live ranks; returns (results, report) like `python -m parlab run collectives`.

    options: numel, dtype, seed, keep_history (see RingOptions)."""
    return launch_scheme("collectives", world_size=world_size, **options)


SCHEMES = [
    Scheme(
        "collectives",
        "ring all-reduce written with send/recv, checked against dist.all_reduce",
        RingOptions,
        ring_rank,
        ring_report,
    )
]
