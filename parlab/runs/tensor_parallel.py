"""Run and check tensor parallelism (parlab/schemes/tensor_parallel.py): `python -m parlab run tp`.

The ranks train the tensor-parallel GPT; the parent gathers their slices to full shape, compares them with one
device, and checks every all-reduce item and the parameter bytes each rank holds against the theory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from parlab.core.check import CountCheck, Verdict, check_equal
from parlab.core.comm import device
from parlab.core.memory import tensor_bytes
from parlab.core.models import build_model, make_batches, make_optimizer
from parlab.core.trace import Trace
from parlab.runs.options import ModelOptions, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import count_checks, model_fields, one_device_checks, run_report, single_device_run
from parlab.runtime.errors import Results
from parlab.schemes.tensor_parallel import (
    PER_LAYER_ITEMS,
    TensorParallelGPT,
    allreduce_theory,
    gather_full,
    param_bytes_theory,
    split_sizes,
    train_tensor_parallel,
)


@dataclass
class TPOptions(ModelOptions):
    batch: int = option(4, "sequences per batch (every rank sees all of them)")

    def validate(self) -> None:
        super().validate()
        P = self.world_size
        bad = [
            f"{name}={n} is not divisible by world_size={P}"
            for name, n in split_sizes(self.gpt_config()).items()
            if n % P
        ]
        if bad:
            raise ValueError("; ".join(bad) + " (tensor parallelism splits each of them across the ranks)")


def tp_rank(opts: TPOptions) -> dict:
    """Rank code: train the tensor-parallel GPT for opts.steps steps; return this rank's slices."""
    cfg, dev = opts.gpt_config(), device()
    model = TensorParallelGPT(build_model(cfg, opts.seed, device=dev)).to(dev)  # same seed everywhere, my slices
    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)
    return train_tensor_parallel(model, optimizer, batches)


def per_step(total: int, steps: int) -> int | float:
    return total // steps if total % steps == 0 else total / steps


def itemise(trace: Trace, steps: int = 1) -> dict[str, list[int | float]]:
    """All-reduce bytes per rank per step, grouped by label with the layer number dropped ("g fwd mlp 1" ->
    "g fwd mlp")."""
    items: dict[str, list[int]] = {}
    for e in trace.select(kind="all_reduce"):
        key = re.sub(r" \d+$", "", e.label)
        items.setdefault(key, [0] * trace.world_size)[e.rank] += e.bytes
    return {k: [per_step(b, steps) for b in v] for k, v in items.items()}


def tp_report(opts: TPOptions, results: Results) -> dict:
    """Compare with the single-device run; check the all-reduce bytes and parameter bytes against theory."""
    cfg = opts.gpt_config()
    counts, comm, param_bytes = _counts(opts, results)
    return run_report(
        "tp",
        opts.world_size,
        _numerics(opts, results) + counts,
        comm=comm,
        **model_fields(cfg, opts),
        **param_bytes,
        param_bytes_single_device=tensor_bytes(build_model(cfg, opts.seed).parameters()),  # host: counted
    )


def _numerics(opts: TPOptions, results: Results) -> list[Verdict | CountCheck]:
    """The ranks' slices gathered to full shape against one device; and the replicated parameters' gradients
    (the LayerNorms, the row-parallel biases) the same on every rank."""
    cfg, steps = opts.gpt_config(), opts.steps
    dims = results[0]["split_dims"]
    checks: list[Verdict | CountCheck] = one_device_checks(
        single_device_run(opts),
        cfg.torch_dtype,
        loss=(f"loss of each of {steps} steps", results[0]["losses"]),
        grads=("every gradient of step 1, gathered to full shape", gather_full([r["grads"] for r in results], dims)),
        params=(
            f"parameters after {steps} {opts.optimizer} steps, gathered",
            gather_full([r["params"] for r in results], dims),
        ),
    )
    # Replicated parameters need no all-reduce only if every rank really computes the same gradient: count.
    replicated = [n for n, d in dims.items() if d is None]
    differing = sum(
        any(not torch.equal(r["grads"][n], results[0]["grads"][n]) for n in replicated) for r in results[1:]
    )
    checks.append(check_equal("ranks whose replicated gradients differ from rank 0's", differing, 0))
    return checks


def _counts(opts: TPOptions, results: Results) -> tuple[list[CountCheck], dict, dict]:
    """The all-reduce bytes per step, item by item, in the layers and in all, the calls, and the parameter bytes
    each rank holds, against the theory. Returns (checks, comm figures, the parameter-bytes report fields)."""
    cfg, P, steps = opts.gpt_config(), opts.world_size, opts.steps
    theory = allreduce_theory(cfg, opts.batch)
    measured = {item: [0] * P for item in theory} | itemise(results.trace, steps)  # {item: [bytes/step per rank]}
    total = [per_step(b, steps) for b in results.trace.bytes_per_rank().get("all_reduce", [0] * P)]
    layers_measured = [sum(measured[i][r] for i in PER_LAYER_ITEMS) for r in range(P)]
    layers_theory = sum(theory[i] for i in PER_LAYER_ITEMS)  # 4 x L x B x T x H x bytes (5 x ... recomputed)
    per_layer = 5 if cfg.recompute == "full" else 4  # full recomputation reruns attention's g in the backward
    calls = [per_step(c, steps) for c in results.trace.count_per_rank("all_reduce")]
    pb, pb_theory = [r["param_bytes"] for r in results], param_bytes_theory(cfg, P)
    # Every rank does the same work: check that, then rank 0's figures against the theory, item by item.
    per_rank = [([measured[i][r] for i in theory], total[r], calls[r], pb[r]) for r in range(P)]
    same = "ranks whose all-reduce bytes, calls or parameter bytes differ from rank 0's"
    rows = [(same, sum(row != per_rank[0] for row in per_rank), 0)]
    rows += [(f"all-reduce bytes per step, {item}", measured[item][0], value) for item, value in theory.items()]
    formula = f"{per_layer} x L x B x T x H x {cfg.dtype_bytes}"
    rows += [
        (f"all-reduce bytes per step in the {cfg.layers} layers ({formula})", layers_measured[0], layers_theory),
        ("all-reduce bytes per step in all", total[0], sum(theory.values())),
        (f"all-reduces per step ({per_layer} per layer + embed + head + 3 loss)", calls[0], per_layer * cfg.layers + 5),
        ("parameter bytes held by each rank", pb[0], pb_theory),
    ]
    comm = {
        **results.trace.bytes_per_rank(),
        "all_reduce_per_step": total,
        "all_reduce_per_step_theory": sum(theory.values()),
        "layers_all_reduce_per_step": layers_measured,
        "layers_all_reduce_per_step_theory": layers_theory,
        "layers_formula": "4 x layers x batch x seq x hidden x dtype bytes",
        "items_per_step": {k: {"measured": measured[k], "theory": v} for k, v in theory.items()},
        "all_reduces_per_step": calls,
    }
    return count_checks(rows), comm, {"param_bytes_per_rank": pb, "param_bytes_per_rank_theory": pb_theory}


def run_tp(world_size: int = 4, **options) -> tuple[Results, dict]:
    """Run the scheme from Python (a notebook): returns (results, report) as `python -m parlab run tp`."""
    return launch_scheme("tp", world_size=world_size, **options)


SCHEMES = [
    Scheme(
        "tp",
        "tensor parallel (Megatron): column/row-parallel MLP and attention, vocab-parallel embedding and loss",
        TPOptions,
        tp_rank,
        tp_report,
        quick=(("steps", 1), ("layers", 1)),
    )
]
