"""Run and check USP (parlab/schemes/sequence/usp.py): `python -m parlab run usp --ulysses 2 --ring 2`.

The ranks train the GPT on a ulysses x ring mesh; the parent compares the losses, the first step's gradients and
the final parameters with one device, and the bytes each rank handed to torch.distributed on each mesh axis (from
the trace, by the axis of the group) with the theory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parlab.core.check import check_equal, compare
from parlab.core.comm import device
from parlab.core.mesh import DeviceMesh
from parlab.core.models import build_model, make_batches, make_optimizer, train_single_device
from parlab.runs.options import ModelOptions, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import run_report
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
    model = USPGPT(build_model(cfg, opts.seed), opts.layout, mesh.group("ulysses"), mesh.group("ring")).to(dev)
    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    batches = [(x.to(dev), y.to(dev)) for x, y in make_batches(cfg, opts.batch, opts.steps, opts.seed)]
    return train_usp(model, optimizer, batches, mesh)


def axis_bytes(trace, axis: str, kind: str, steps: int, P: int) -> list:
    """Bytes per rank per step this rank handed to `kind` calls on the groups of mesh axis `axis`."""
    per_rank = [sum(e.bytes for e in trace.select(kind=kind, rank=r, axis=axis)) for r in range(P)]
    return [per_step(b, steps) for b in per_rank]


def usp_report(opts: USPOptions, results: Results) -> dict:
    """Compare with the single-device run; check the bytes on each mesh axis and the tiles against the theory."""
    cfg, P, steps, B, L = opts.gpt_config(), opts.world_size, opts.steps, opts.batch, opts.layers
    trace = results.trace
    ref = train_single_device(cfg, make_batches(cfg, B, steps, opts.seed), opts.seed, opts.optimizer, opts.lr)
    losses = [sum(r["losses"][s] for r in results) for s in range(steps)]  # the ranks' shares sum to the mean
    verdicts: list = [
        compare(
            f"loss of each of {steps} steps",
            torch.tensor(losses, dtype=cfg.torch_dtype),
            torch.tensor(ref.losses, dtype=cfg.torch_dtype),
        ),
        compare("every gradient of step 1", results[0]["grads"], ref.grads),
        compare(f"parameters after {steps} {opts.optimizer} steps", results[0]["params"], ref.params),
    ]
    verdicts.append(
        check_equal(
            "ranks whose parameters differ from rank 0's after training",
            sum(any(not torch.equal(r["params"][n], t) for n, t in results[0]["params"].items()) for r in results[1:]),
            0,
        )
    )
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
    for axis, what in (
        ("ulysses", "all-to-all payload (8 per layer: q, k, v, out; fwd and bwd)"),
        ("ring", "send bytes (K/V fwd and bwd, dK/dV bwd)"),
    ):
        verdicts += [
            check_equal(f"{axis} axis: {what} per step, rank 0", measured[axis][0], theory[axis]),
            check_equal(
                f"{axis} axis: ranks whose bytes differ from rank 0's",
                sum(b != measured[axis][0] for b in measured[axis]),
                0,
            ),
        ]
    verdicts += [
        check_equal(
            "gradient all-reduce bytes per step (every parameter, over all ranks)",
            grads[0],
            grad_sync_theory(cfg, "ring", P),
        ),
        check_equal(
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
    return run_report(
        "usp",
        P,
        verdicts,
        ulysses=opts.ulysses,
        ring=opts.ring,
        layout=opts.layout,
        comm=comm,
        tiles_computed_per_rank=tiles,
        tiles_theory=expected_tiles,
        seq=cfg.seq_len,
        heads=cfg.heads,
        hidden=cfg.hidden,
        layers=L,
        batch=B,
        dtype=cfg.dtype,
        steps=steps,
    )


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
    ),
]
