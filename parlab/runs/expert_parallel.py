"""Run and check expert parallelism (parlab/schemes/expert_parallel.py): `python -m parlab run moe --experts 8 --top-k
2`.

The ranks train a Mixture-of-Experts GPT with its experts spread over the ep axis (inside data parallelism when
--dp > 1); the parent trains one device on the whole batch, routed in the same capacity groups (one per rank),
and compares losses (aux included), gradients and parameters, then puts the bytes each rank handed to
all_to_all_single (from the trace) beside the bytes its split sizes call for, and reports the load per expert
and the dropped tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parlab.core.check import compare
from parlab.core.comm import device
from parlab.core.mesh import DeviceMesh, mesh_coords
from parlab.core.models import GPTConfig, build_model, make_batches
from parlab.core.moe import MoEConfig, check_moe, moe_layers
from parlab.runs.options import ModelOptions, option, positive
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import compare_losses, count_checks, mean_losses, model_fields, run_report, single_device_run
from parlab.runtime.errors import Results
from parlab.schemes.expert_parallel import (
    all_to_all_payload,
    balanced_all_to_all_bytes,
    local_experts,
    train_expert_parallel,
)


@dataclass
class MoEOptions(ModelOptions):
    experts: int = option(8, "E, experts per MoE layer (spread over the ep axis: E / ep per rank)")
    top_k: int = option(2, "k, experts each token is sent to")
    capacity_factor: float = option(
        1.25, "slots per expert and rank = ceil(factor x tokens x k / E)", bounds="(0, 1000]"
    )
    drop: bool = option(True, "drop the tokens past an expert's capacity (--no-drop: every expert takes all)")
    aux_weight: float = option(0.01, "weight of the load-balancing loss in the training loss", bounds="[0, 100]")
    moe_every: int = option(1, "an MoE FFN in every block (1) or every other block (2)")
    dp: int = option(1, "data-parallel replicas (the dp axis); the ep axis is world / dp")

    @property
    def ep(self) -> int:
        return self.world_size // self.dp

    @property
    def axes(self) -> dict[str, int]:
        return {"dp": self.dp, "ep": self.ep}

    def validate(self) -> None:
        super().validate()
        positive("dp", self.dp)
        positive("moe_every", self.moe_every)
        if self.world_size % self.dp:
            raise ValueError(f"world_size={self.world_size} is not divisible by dp={self.dp} (ep = world / dp)")
        check_moe(self.experts, self.top_k, self.capacity_factor, self.ep)
        if self.batch % self.world_size:
            raise ValueError(f"batch={self.batch} is not divisible by world_size={self.world_size} (rows per rank)")
        if self.aux_weight < 0:
            raise ValueError(f"aux_weight={self.aux_weight} must be >= 0")
        if not self.drop:
            self.no_effect(("capacity_factor",), "with drop off (--no-drop: every expert takes every token)")

    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            self.experts,
            self.top_k,
            self.capacity_factor,
            self.drop,
            self.aux_weight,
            self.moe_every,
            groups=self.world_size,
        )

    def gpt_config(self) -> GPTConfig:
        cfg = super().gpt_config()
        return GPTConfig(**{**cfg.__dict__, "moe": self.moe_config()})


def moe_rank(opts: MoEOptions) -> dict:
    """Rank code: the mesh (dp x ep), the full model (same weights everywhere), then expert-parallel training."""
    mesh = DeviceMesh(opts.axes)
    cfg, dev = opts.gpt_config(), device()  # dev: this rank's GPU under NCCL, else the CPU
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)
    model = build_model(cfg, opts.seed, device=dev)
    return train_expert_parallel(model, mesh, batches, optimizer=opts.optimizer, lr=opts.lr)


def reference_routing(cfg: GPTConfig, x: torch.Tensor, seed: int) -> dict:
    """One device's first forward: aux loss (summed over layers), load per expert and dropped assignments."""
    model = build_model(cfg, seed)  # host: the parent's reference
    with torch.no_grad():
        model(x)
    layers = moe_layers(model)
    return {
        "aux": sum(m.aux_loss.item() for m in layers),
        "load": [sum(m.stats["load"][e] for m in layers) for e in range(cfg.moe.experts)],
        "dropped": sum(m.stats["dropped"] for m in layers),
    }


def moe_report(opts: MoEOptions, results: Results) -> dict:
    """Compare with one device; check the all-to-all bytes against the split sizes; the load and the drops."""
    cfg, W, K = opts.gpt_config(), opts.world_size, opts.steps
    coords = [mesh_coords(r, opts.axes) for r in range(W)]
    reference = single_device_run(opts)
    x = make_batches(cfg, opts.batch, 1, opts.seed)[0][0]  # host: the parent's reference
    ref_routing = reference_routing(cfg, x, opts.seed)
    loss = mean_losses(results, K)  # equal rows per rank: the mean of the ranks' means
    verdicts = _numerics(opts, results, coords, reference, ref_routing, loss)
    routing_checks, routing = _routing(opts, results, coords, ref_routing)
    bytes_checks, bytes_fields = _all_to_all(opts, results)
    return run_report(
        "moe",
        W,
        verdicts + routing_checks + bytes_checks,
        comm=results.trace.bytes_per_rank(),
        mesh={"axes": opts.axes, "coords": coords},
        **model_fields(cfg, opts, "steps"),
        experts=opts.experts,
        top_k=opts.top_k,
        capacity_factor=opts.capacity_factor,
        drop=opts.drop,
        capacity_per_rank=results[0]["stats"][0][0]["capacity"],
        moe_layers=len(results[0]["stats"][0]),
        tokens_per_rank=opts.batch // W * cfg.seq_len,
        loss_single=reference.losses,
        loss_parallel=loss,
        aux_loss=[sum(r["aux"][k] for r in results) / W for k in range(K)],
        **routing,
        **bytes_fields,
    )


def _numerics(opts: MoEOptions, results: Results, coords: list[dict], reference, ref_routing: dict, loss) -> list:
    """The loss (aux included) and the aux loss of step 1 against one device routing the same groups; then each
    dp replica, which holds every expert once over its ep ranks, put together and compared."""
    cfg, W, K = opts.gpt_config(), opts.world_size, opts.steps
    aux1 = sum(r["aux"][0] for r in results) / W
    verdicts = [
        compare_losses(f"loss (aux included) of each of {K} steps", loss, reference.losses, cfg.torch_dtype),
        compare_losses("aux loss of step 1", [aux1], [ref_routing["aux"]], cfg.torch_dtype),
    ]
    for replica in range(opts.dp):
        ranks = [r for r in range(W) if coords[r]["dp"] == replica]
        grads = {n: g for r in ranks for n, g in results[r]["grads"].items()}
        params = {n: p for r in ranks for n, p in results[r]["params"].items()}
        verdicts.append(compare(f"replica {replica}: gradients of step 1, gathered", grads, reference.grads))
        verdicts.append(compare(f"replica {replica}: parameters after {K} steps, gathered", params, reference.params))
    return verdicts


def _routing(opts: MoEOptions, results: Results, coords: list[dict], ref_routing: dict) -> tuple[list, dict]:
    """Routing: what the ranks measured (assignments per expert, drops, rows each expert took), against one
    device routing the same groups in step 1. Returns (checks, the routing report fields)."""
    E, K, W = opts.experts, opts.steps, opts.world_size
    load = [[sum(layer["load"][e] for step in r["stats"] for layer in step) for e in range(E)] for r in results]
    load1 = [sum(layer["load"][e] for r in results for layer in r["stats"][0]) for e in range(E)]
    dropped_per_step = [sum(layer["dropped"] for r in results for layer in r["stats"][k]) for k in range(K)]
    received = [0] * E  # rows each expert took (after drops), over steps, layers and dp replicas
    for r, res in enumerate(results):
        mine = local_experts(E, opts.ep, coords[r]["ep"])
        for layer in (layer for step in res["stats"] for layer in step):
            for e, rows in zip(mine, layer["rows_per_expert"], strict=True):
                received[e] += rows
    differing = sum(a != b for a, b in zip(load1, ref_routing["load"], strict=True))
    checks = count_checks(
        [
            ("step 1: assignments per expert differing from one device", differing, 0),
            ("step 1: dropped assignments, all ranks (one device's)", dropped_per_step[0], ref_routing["dropped"]),
        ]
    )
    tokens, moe_per_step = opts.batch // W * opts.gpt_config().seq_len, len(results[0]["stats"][0])
    fields = {
        "tokens_per_expert": {"per_rank": load, "step1_total": load1, "imbalance_step1": max(load1) / (sum(load1) / E)},
        "received_per_expert": received,
        "dropped_tokens": {
            "total": sum(dropped_per_step),
            "per_step": dropped_per_step,
            "assignments_per_step": W * tokens * opts.top_k * moe_per_step,
        },
    }
    return checks, fields


def _all_to_all(opts: MoEOptions, results: Results) -> tuple[list, dict]:
    """Bytes: what each rank handed to all_to_all_single (the trace) against what its split sizes call for, and
    the balanced case's formula beside them. Returns (checks, the report fields)."""
    cfg, W, E = opts.gpt_config(), opts.world_size, opts.experts
    measured = results.trace.bytes_per_rank().get("all_to_all", [0] * W)
    recomputed = cfg.recompute == "full"  # each MoE block's forward, all-to-alls included, runs again in backward
    theory = [
        sum(
            all_to_all_payload(
                sum(layer["send_splits"]), sum(layer["recv_splits"]), cfg.hidden, cfg.dtype_bytes, E, recomputed
            )
            for step in r["stats"]
            for layer in step
        )
        for r in results
    ]
    wrong = sum(m != t for m, t in zip(measured, theory, strict=True))
    tokens = opts.batch // W * cfg.seq_len  # per rank
    fields = {
        "all_to_all_bytes": measured,
        "all_to_all_theory": theory,
        "all_to_all_balanced": {
            "per_layer_direction": balanced_all_to_all_bytes(tokens, opts.top_k, cfg.hidden, cfg.dtype_bytes, opts.ep),
            "formula": "tokens x k x H x bytes per direction (payload); x (P-1)/P leaves the rank (wire)",
        },
    }
    return count_checks([("ranks whose all-to-all bytes differ from their split sizes", wrong, 0)]), fields


def run_moe(world_size: int = 4, **options) -> tuple[Results, dict]:
    """Run expert parallelism on live ranks; returns (results, report) as `python -m parlab run moe` prints it.

    options: any MoEOptions field (experts, top_k, capacity_factor, drop, dp, steps, batch, layers, ...).
    """
    return launch_scheme("moe", world_size=world_size, **options)


SCHEMES = [
    Scheme(
        "moe",
        "expert parallelism: a Mixture-of-Experts GPT, experts spread over ranks, all-to-all dispatch and combine",
        MoEOptions,
        moe_rank,
        moe_report,
    )
]
