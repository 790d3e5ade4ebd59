"""Run and check USP (parlab/schemes/sequence/usp.py): `python -m parlab run usp --ulysses 2 --ring 2`.

The ranks train the GPT on a ulysses x ring mesh; the parent compares the losses, the first step's gradients and
the final parameters with one device, and the bytes each rank handed to torch.distributed on each mesh axis (from
the trace, by the axis of the group) with the theory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parlab.core.check import check_equal
from parlab.core.comm import device
from parlab.core.mesh import DeviceMesh
from parlab.core.models import build_model, make_batches, make_optimizer
from parlab.runs.options import ModelOptions, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import count_checks, model_fields, one_device_checks, run_report, single_device_run
from parlab.runs.tensor_parallel import per_step
from parlab.runtime.errors import Results
from parlab.schemes.sequence.ring_attention import LAYOUTS, tiles_theory
from parlab.schemes.sequence.sequence_parallel import grad_sync_theory
from parlab.schemes.sequence.usp import USPGPT, check_usp, train_usp, usp_bytes_per_call, usp_mesh_axes


@dataclass
class USPOptions(ModelOptions):
    batch: int = option(2, "sequences per batch (every rank holds its T/P tokens of each)")
    ulysses: int = option(2, "ranks on the ulysses axis U (all-to-all to a head split; must divide the heads)")
    ring: int = option(2, "ranks on the ring axis R (ring attention across the ulysses groups)")
    layout: str = option("contiguous", "how the ring axis cuts the sequence", choices=list(LAYOUTS))

    def validate(self) -> None:
        super().validate()
        check_usp(self.heads, self.seq, self.ulysses, self.ring, self.world_size, self.layout)
        if self.recompute != "none":
            raise ValueError(
                f"recompute={self.recompute!r} is not applied by usp (its GPT runs the blocks' layers "
                "itself, not the reference Block that recomputes); dp, pp and zero take it"
            )


def usp_rank(opts: USPOptions) -> dict:
    """Rank code: build the ulysses x ring mesh, train the GPT with USP attention for opts.steps steps."""
    cfg, dev = opts.gpt_config(), device()
    mesh = DeviceMesh(usp_mesh_axes(opts.ulysses, opts.ring))  # collective: every rank builds it
    full = build_model(cfg, opts.seed, device=dev)
    model = USPGPT(full, opts.layout, mesh.group("ulysses"), mesh.group("ring")).to(dev)  # .to: what it adds too
    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)
    return train_usp(model, optimizer, batches, mesh)


def axis_bytes(trace, axis: str, kind: str, steps: int, P: int) -> list:
    """Bytes per rank per step this rank handed to `kind` calls on the groups of mesh axis `axis`."""
    per_rank = [sum(e.bytes for e in trace.select(kind=kind, rank=r, axis=axis)) for r in range(P)]
    return [per_step(b, steps) for b in per_rank]


def usp_report(opts: USPOptions, results: Results) -> dict:
    """Compare with the single-device run; check the bytes on each mesh axis and the tiles against the theory."""
    checks, comm, tiles = _traffic(opts, results)
    return run_report(
        "usp",
        opts.world_size,
        _numerics(opts, results) + checks,
        ulysses=opts.ulysses,
        ring=opts.ring,
        layout=opts.layout,
        comm=comm,
        **tiles,
        **model_fields(opts.gpt_config(), opts, "seq", "heads", "hidden", "layers", "batch", "dtype", "steps"),
    )


def _numerics(opts: USPOptions, results: Results) -> list:
    """The run against one device (every rank holds the whole model; its loss is its share of the mean), and
    every rank's parameters equal to rank 0's after training."""
    steps = opts.steps
    losses = [sum(r["losses"][s] for r in results) for s in range(steps)]  # the ranks' shares sum to the mean
    checks: list = one_device_checks(
        single_device_run(opts),
        opts.gpt_config().torch_dtype,
        loss=(f"loss of each of {steps} steps", losses),
        grads=("every gradient of step 1", results[0]["grads"]),
        params=(f"parameters after {steps} {opts.optimizer} steps", results[0]["params"]),
    )
    ours = results[0]["params"]
    differing = sum(any(not torch.equal(r["params"][n], t) for n, t in ours.items()) for r in results[1:])
    checks.append(check_equal("ranks whose parameters differ from rank 0's after training", differing, 0))
    return checks


def _traffic(opts: USPOptions, results: Results) -> tuple[list, dict, dict]:
    """The bytes on each mesh axis (ulysses: all-to-alls; ring: sends) and the gradient all-reduce against the
    theory, and the attention tiles each rank computed against ring attention's over the R ring ranks.
    Returns (checks, comm figures, the tile report fields)."""
    cfg, P, steps, B, L = opts.gpt_config(), opts.world_size, opts.steps, opts.batch, opts.layers
    trace = results.trace
    per_call = usp_bytes_per_call(B, cfg.heads, cfg.seq_len, cfg.head_size, opts.ulysses, opts.ring, cfg.dtype_bytes)
    theory = {"ulysses": L * per_call["ulysses"], "ring": L * per_call["ring"]}
    measured = {
        "ulysses": axis_bytes(trace, "ulysses", "all_to_all", steps, P),
        "ring": axis_bytes(trace, "ring", "send", steps, P),
    }
    grads = [
        per_step(sum(e.bytes for e in trace.select(kind="all_reduce", rank=r) if e.label == "grads"), steps)
        for r in range(P)
    ]
    tiles = [sum(e.extra.get("attn") == "fwd" for e in trace.select(kind="compute", rank=r)) for r in range(P)]
    tiles = [per_step(t, steps * L) for t in tiles]
    expected_tiles = [tiles_theory(opts.ring, opts.layout)[r // opts.ulysses] for r in range(P)]
    rows = []
    for axis, what in (
        ("ulysses", "all-to-all payload (8 per layer: q, k, v, out; fwd and bwd)"),
        ("ring", "send bytes (K/V fwd and bwd, dK/dV bwd)"),
    ):
        rows += [
            (f"{axis} axis: {what} per step, rank 0", measured[axis][0], theory[axis]),
            (
                f"{axis} axis: ranks whose bytes differ from rank 0's",
                sum(b != measured[axis][0] for b in measured[axis]),
                0,
            ),
        ]
    rows += [
        (
            "gradient all-reduce bytes per step (every parameter, over all ranks)",
            grads[0],
            grad_sync_theory(cfg, "ring", P),
        ),
        (
            "ranks whose attention tiles per forward differ from ring attention's over R",
            sum(t != e for t, e in zip(tiles, expected_tiles, strict=True)),
            0,
        ),
    ]
    comm = {
        **trace.bytes_per_rank(),
        "ulysses_per_step": measured["ulysses"],
        "ulysses_per_step_theory": theory["ulysses"],
        "ring_per_step": measured["ring"],
        "ring_per_step_theory": theory["ring"],
        "grad_all_reduce_per_step": grads,
        "ring_block_bytes": per_call["ring_block"],
        "a2a_call_bytes": per_call["a2a_call"],
    }
    return count_checks(rows), comm, {"tiles_computed_per_rank": tiles, "tiles_theory": expected_tiles}


def run_usp(ulysses: int = 2, ring: int = 2, **options) -> tuple[Results, dict]:
    """Run USP from Python (a notebook) on ulysses x ring ranks: (results, report) as `python -m parlab run usp`."""
    return launch_scheme("usp", world_size=ulysses * ring, ulysses=ulysses, ring=ring, **options)


SCHEMES = [
    Scheme(
        "usp",
        "USP: Ulysses all-to-all inside, ring attention across, on a ulysses x ring mesh",
        USPOptions,
        usp_rank,
        usp_report,
        not_offered=("recompute",),  # its GPT runs the blocks' layers itself (USPOptions.validate)
    ),
]
