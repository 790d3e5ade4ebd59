"""Run and check sequence parallelism (parlab/schemes/sequence/sequence_parallel.py): `python -m parlab run
megatron-sp|ulysses|ring| ring-zigzag`, and USP (parlab/schemes/sequence/usp.py, its run in parlab/runs/usp.py): `python
-m parlab run usp --ulysses 2 --ring 2`.

The ranks train the GPT with the method's sequence split; the parent compares the losses, the first step's
gradients and the final parameters with one device, and checks the measured communication (and, for Megatron
SP, the LayerNorm activations; for ring attention, the tiles each rank computed) against the theory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from parlab.core.check import CountCheck, Verdict, check_equal
from parlab.core.comm import device
from parlab.core.memory import saved_activations
from parlab.core.models import build_model, make_batches, make_optimizer
from parlab.runs.options import ModelOptions, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import count_checks, model_fields, one_device_checks, run_report, single_device_run
from parlab.runs.tensor_parallel import per_step
from parlab.runtime.errors import Results
from parlab.schemes.sequence.ring_attention import tiles_theory
from parlab.schemes.sequence.sequence_parallel import (
    METHODS,
    MegatronSPGPT,
    SequenceShardedGPT,
    grad_sync_theory,
    megatron_needs_tp,
    megatron_sp_layer_theory,
    ring_theory,
    train_sequence_parallel,
    ulysses_theory,
    wire_bytes,
)
from parlab.schemes.sequence.ulysses import check_heads
from parlab.schemes.tensor_parallel import PER_LAYER_ITEMS, allreduce_theory, gather_full, split_sizes


@dataclass
class SPOptions(ModelOptions):
    method: str = option("ring", "megatron-sp, ulysses, ring or ring-zigzag", choices=list(METHODS))
    batch: int = option(2, "sequences per batch (every rank sees all of them, or its part of each)")

    def validate(self) -> None:
        super().validate()
        P, T = self.world_size, self.seq
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} must be one of {list(METHODS)}")
        check_recompute_applied(self.recompute, self.method)
        if self.method == "megatron-sp":
            if P < 2:
                raise ValueError(megatron_needs_tp(P))
            bad = [
                f"{k}={n} is not divisible by world_size={P}"
                for k, n in split_sizes(self.gpt_config()).items()
                if n % P
            ]
            if bad:
                raise ValueError(
                    "; ".join(bad) + " (Megatron SP runs on tensor parallelism, which splits each of them)"
                )
        if self.method == "ulysses":
            check_heads(self.heads, P)
        if self.method == "ring-zigzag":
            if T % (2 * P):
                raise ValueError(
                    f"seq={T} is not divisible by 2 x world_size = {2 * P}: the zigzag layout cuts the sequence into "
                    f"2P chunks (rank r holds chunks r and 2P-1-r)"
                )
        elif T % P:
            raise ValueError(f"seq={T} is not divisible by world_size={P}: each rank holds T/P tokens")


def check_recompute_applied(recompute: str, method: str) -> None:
    """Refuse a recompute mode the method's model would ignore: these GPTs run their blocks' layers themselves
    (parlab/schemes/sequence/sequence_parallel.py), not the reference Block's forward that checkpoints
    (parlab/schemes/recompute/measure.py)."""
    if recompute != "none" and method != "megatron-sp":
        raise ValueError(
            f"recompute={recompute!r} is not applied by {method} (its GPT runs the blocks' layers itself, not the "
            "reference Block that recomputes); megatron-sp, tp and the runs of the reference blocks (dp, pp) take it"
        )


def make_model(opts: SPOptions, group=None, device=None):
    full = build_model(opts.gpt_config(), opts.seed, device=device)  # the same seed on every rank
    if opts.method == "megatron-sp":
        return MegatronSPGPT(full, group=group)
    return SequenceShardedGPT(full, opts.method, group=group)


def layernorm_saved_bytes(opts: SPOptions, world_size: int) -> dict[str, int]:
    """Saved activations (parlab.core.memory) of one LayerNorm on a rank's tokens: Megatron SP's [B, T/P, H] vs
    tensor parallelism's replicated [B, T, H]."""
    cfg = opts.gpt_config()
    # On the host: bytes are counted, nothing is communicated, and they are the same on any device.
    ln = build_model(cfg, opts.seed).blocks[0].ln1  # host: a byte count, no collective
    out = {}
    for name, tokens in (("sp", cfg.seq_len // world_size), ("tp", cfg.seq_len)):
        x = torch.randn(opts.batch, tokens, cfg.hidden, dtype=cfg.torch_dtype, requires_grad=True)  # host: as ln
        with saved_activations(exclude=ln) as saved:
            ln(x)
        out[name] = saved.bytes
    return out


def sp_rank(opts: SPOptions) -> dict:
    """Rank code: train the GPT with opts.method's sequence split for opts.steps steps."""
    cfg, dev = opts.gpt_config(), device()
    model = make_model(opts, device=dev).to(dev)  # (.to: whatever the wrapper adds goes there too)
    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)
    out = train_sequence_parallel(model, optimizer, batches)
    if opts.method == "megatron-sp":
        out["layernorm_saved"] = layernorm_saved_bytes(opts, opts.world_size)
    return out


def _layer_payload(trace, kind: str, steps: int, P: int) -> list:
    per_rank = [0] * P
    for e in trace.select(kind=kind):
        if re.search(r"(attn|mlp) \d+$", e.label):
            per_rank[e.rank] += e.bytes
    return [per_step(b, steps) for b in per_rank]


def tiles_measured(trace, P: int, calls: int) -> list:
    """Attention tiles each rank computed per forward attention call, counted from the trace's tile spans."""
    counts = [0] * P
    for e in trace.select(kind="compute"):
        if e.extra.get("attn") == "fwd":
            counts[e.rank] += 1
    return [per_step(c, calls) for c in counts]


def _comm_checks(opts: SPOptions, results: Results) -> tuple[list[CountCheck], dict, dict]:
    """The measured communication (and tiles, memory) against the theory: (checks, comm figures, extra keys).
    Every method all-reduces the gradients once a step; what moves inside the layers is the method's own."""
    cfg, P, steps, method = opts.gpt_config(), opts.world_size, opts.steps, opts.method
    trace = results.trace
    grads_ar = [
        per_step(
            sum(e.bytes for e in trace.select(kind="all_reduce", rank=r) if e.label in ("grads", "sp grads")), steps
        )
        for r in range(P)
    ]
    theory = grad_sync_theory(cfg, method, P)
    figures = {"grad_all_reduce_per_step": grads_ar, "grad_all_reduce_per_step_theory": theory}
    checks = [check_equal("gradient all-reduce bytes per step", grads_ar[0], theory)]
    layer_checks = {"megatron-sp": _megatron_checks, "ulysses": _ulysses_checks}.get(method, _ring_checks)
    more, more_figures, extra = layer_checks(opts, results)
    return checks + more, figures | more_figures, extra


def _megatron_checks(opts: SPOptions, results: Results) -> tuple[list[CountCheck], dict, dict]:
    """Megatron SP: the layers' all-gathers and reduce-scatters against the theory, the bytes they send against
    the tensor-parallel all-reduces they replace, and the LayerNorm's saved activations cut by P."""
    cfg, P, steps, B = opts.gpt_config(), opts.world_size, opts.steps, opts.batch
    trace = results.trace
    theory = megatron_sp_layer_theory(cfg, B, P)
    ag, rs = _layer_payload(trace, "all_gather", steps, P), _layer_payload(trace, "reduce_scatter", steps, P)
    tp_ar = sum(allreduce_theory(cfg, B)[i] for i in PER_LAYER_ITEMS)  # what tensor parallelism all-reduces
    sp_wire = [wire_bytes("all_gather", ag[r], P) + wire_bytes("reduce_scatter", rs[r], P) for r in range(P)]
    tp_wire, same_as = wire_bytes("all_reduce", tp_ar, P), "the tensor-parallel all-reduces they replace"
    n_ag, n_rs = (6, 5) if cfg.recompute == "full" else (4, 4)  # full recomputation reruns 2 AG + 1 RS a layer
    if cfg.recompute == "full":  # no longer TP's bytes: TP reruns 1 all-reduce a layer
        same_as = "the ring formulas of the measured counts"
        tp_wire = wire_bytes("all_gather", theory["all_gather"], P) + wire_bytes(
            "reduce_scatter", theory["reduce_scatter"], P
        )
    ln = results[0]["layernorm_saved"]
    in_layers = sum(1 for e in trace.select(kind="all_reduce") if re.search(r"(attn|mlp) \d+$", e.label))
    rows = [
        (
            "ranks whose layer all-gather/reduce-scatter bytes differ from rank 0's",
            sum((ag[r], rs[r]) != (ag[0], rs[0]) for r in range(P)),
            0,
        ),
        (f"all-gather bytes per step in the layers ({n_ag} x L x B x T/P x H x bytes)", ag[0], theory["all_gather"]),
        (
            f"reduce-scatter bytes per step in the layers ({n_rs} x L x B x T x H x bytes)",
            rs[0],
            theory["reduce_scatter"],
        ),
        (
            f"bytes sent per step in the layers (ring algorithms): all-gather + reduce-scatter = {same_as}",
            sp_wire[0],
            tp_wire,
        ),
        ("all-reduces inside the layers", in_layers, 0),
        (f"LayerNorm saved activations x P: Megatron SP's x {P} = tensor parallel's", ln["sp"] * P, ln["tp"]),
    ]
    figures = {
        "layers_all_gather_per_step": ag,
        "layers_reduce_scatter_per_step": rs,
        "layers_theory": theory,
        "layers_sent_per_step": sp_wire,
        "tp_all_reduce_sent_per_step": tp_wire,
        "tp_all_reduce_payload_per_step": tp_ar,
    }
    return count_checks(rows), figures, {"layernorm_saved_bytes": {"sp_per_rank": ln["sp"], "tp_per_rank": ln["tp"]}}


def _ulysses_checks(opts: SPOptions, results: Results) -> tuple[list[CountCheck], dict, dict]:
    """Ulysses: the all-to-alls to the head split and back (q, k, v, out; forward and backward) against theory."""
    cfg, P, steps, trace = opts.gpt_config(), opts.world_size, opts.steps, results.trace
    a2a = [per_step(b, steps) for b in trace.bytes_per_rank().get("all_to_all", [0] * P)]
    calls = [per_step(c, steps) for c in trace.count_per_rank("all_to_all")]
    theory = ulysses_theory(cfg, opts.batch, P)
    rows = [
        ("ranks whose all-to-all bytes differ from rank 0's", sum(b != a2a[0] for b in a2a), 0),
        ("all-to-all bytes per rank per step (8 x L x B x nh x T/P x hs x bytes)", a2a[0], theory),
        ("all-to-alls per step (q, k, v, out; forward and backward; per layer)", calls[0], 8 * cfg.layers),
    ]
    return count_checks(rows), {"all_to_all_per_step": a2a, "all_to_all_per_step_theory": theory}, {}


def _ring_checks(opts: SPOptions, results: Results) -> tuple[list[CountCheck], dict, dict]:
    """Ring attention: the K/V (and dK/dV) blocks sent round the ring against theory, and the attention tiles
    each rank computed against the causal mask's (zigzag: the same number on every rank)."""
    cfg, P, steps, trace = opts.gpt_config(), opts.world_size, opts.steps, results.trace
    theory, layout = ring_theory(cfg, opts.batch, P), "zigzag" if opts.method == "ring-zigzag" else "contiguous"
    sends = {
        item: [
            per_step(sum(e.bytes for e in trace.select(kind="send", rank=r) if e.label.startswith(item)), steps)
            for r in range(P)
        ]
        for item in ("kv fwd", "kv bwd", "dkv bwd")
    }
    n_fwd = [
        per_step(sum(e.label.startswith("kv fwd") for e in trace.select(kind="send", rank=r)), steps * cfg.layers)
        for r in range(P)
    ]
    tiles = tiles_measured(trace, P, steps * cfg.layers)
    rows = [(f"ring send bytes per step, {item}", sends[item][0], theory[item]) for item in sends]
    rows += [
        (
            "ranks whose sends differ from rank 0's",
            sum([sends[i][r] for i in sends] != [sends[i][0] for i in sends] for r in range(P)),
            0,
        ),
        ("K/V blocks each rank sends per forward attention (P-1)", n_fwd[0], P - 1),
        (
            "ranks whose tile counts differ from the causal theory",
            sum(t != th for t, th in zip(tiles, tiles_theory(P, layout), strict=True)),
            0,
        ),
    ]
    if layout == "zigzag":
        rows.append(
            ("zigzag: ranks computing a different number of tiles from rank 0", sum(t != tiles[0] for t in tiles), 0)
        )
    figures = {"send_per_step": sends, "send_per_step_theory": theory, "kv_blocks_sent_per_forward": n_fwd}
    extra = {"tiles_computed_per_rank": tiles, "tiles_theory": tiles_theory(P, layout), "layout": layout}
    return count_checks(rows), figures, extra


def sp_report(opts: SPOptions, results: Results) -> dict:
    """Compare with the single-device run; check the communication against the theory."""
    cfg = opts.gpt_config()
    checks, figures, extra = _comm_checks(opts, results)
    return run_report(
        opts.method,
        opts.world_size,
        _numerics(opts, results) + checks,
        comm={**results.trace.bytes_per_rank(), **figures},
        **model_fields(cfg, opts, "seq", "heads", "hidden", "layers", "batch", "dtype", "steps"),
        **extra,
        param_bytes_per_rank=[r["param_bytes"] for r in results],
    )


def _numerics(opts: SPOptions, results: Results) -> list[Verdict | CountCheck]:
    """The run against one device; and the replicated parameters equal on every rank after training.

    Megatron SP splits the weights (gathered here to full shape) and every rank computes the whole loss; the
    other methods keep the whole model on every rank and each rank's loss is its share of the mean."""
    cfg, steps = opts.gpt_config(), opts.steps
    if opts.method == "megatron-sp":
        losses = results[0]["losses"]  # every rank computes the whole loss
        dims = results[0]["split_dims"]
        grads = gather_full([r["grads"] for r in results], dims)
        params = gather_full([r["params"] for r in results], dims)
    else:
        losses = [sum(r["losses"][s] for r in results) for s in range(steps)]  # the ranks' shares sum to the mean
        grads, params = results[0]["grads"], results[0]["params"]
    checks: list[Verdict | CountCheck] = one_device_checks(
        single_device_run(opts),
        cfg.torch_dtype,
        loss=(f"loss of each of {steps} steps", losses),
        grads=("every gradient of step 1" + (", gathered" if opts.method == "megatron-sp" else ""), grads),
        params=(f"parameters after {steps} {opts.optimizer} steps", params),
    )
    replicated = [n for n, d in results[0]["split_dims"].items() if d is None]
    differing = sum(
        any(not torch.equal(r["params"][n], results[0]["params"][n]) for n in replicated) for r in results[1:]
    )
    checks.append(check_equal("ranks whose replicated parameters differ from rank 0's after training", differing, 0))
    return checks


def run_sp(method: str = "ring", world_size: int = 4, **options) -> tuple[Results, dict]:
    """Run one method from Python (a notebook): returns (results, report) as `python -m parlab run METHOD`."""
    return launch_scheme(method, world_size=world_size, **options)


SCHEMES = [
    Scheme(
        "megatron-sp",
        "Megatron sequence parallelism on tensor parallelism: LayerNorm regions split along the sequence",
        SPOptions,
        sp_rank,
        sp_report,
        fixed=(("method", "megatron-sp"),),
        quick=(("steps", 1), ("layers", 1)),
    ),
    Scheme(
        "ulysses",
        "DeepSpeed-Ulysses: sequence split, all-to-all to a head split around attention",
        SPOptions,
        sp_rank,
        sp_report,
        fixed=(("method", "ulysses"),),
        not_offered=("recompute",),  # its GPT runs the blocks' layers itself: check_recompute_applied
    ),
    Scheme(
        "ring",
        "Ring Attention: sequence split, K/V blocks passed round a ring, online-softmax merge",
        SPOptions,
        sp_rank,
        sp_report,
        fixed=(("method", "ring"),),
        not_offered=("recompute",),  # its GPT runs the blocks' layers itself: check_recompute_applied
    ),
    Scheme(
        "ring-zigzag",
        "Ring Attention, zigzag layout: rank r holds chunks r and 2P-1-r, equal causal work",
        SPOptions,
        sp_rank,
        sp_report,
        fixed=(("method", "ring-zigzag"),),
        not_offered=("recompute",),  # its GPT runs the blocks' layers itself: check_recompute_applied
    ),
]
