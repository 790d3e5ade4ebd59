"""A planner: for a model, a cluster and a batch, which combination of parallelism fits, and which talks least.

Every formula here is one a lesson measured at small size:

    parameters        Psi = L (4H^2 + 4H + 2HF + F + H + 4H) + V H (x2 untied) + T H + 2H        (the reference GPT)
    per device        a pipeline stage's blocks (L / pp of them; the first and last stage add the embeddings and
                      the head), their big matrices split over tp, LayerNorms and row-parallel biases replicated
    model states      params, grads, optimizer states: p + g + K bytes per parameter (mixed precision: 2 + 2 + 12);
                      ZeRO stage z over the dp axis divides the optimizer (z >= 1), grads (z >= 2), params (z = 3)
                      by dp (lesson 05); CPU offload moves grads and optimizer states to host memory (lesson 06)
    activations       per layer and micro-batch (Korthikanti et al. 2022, 2-byte activations, no recomputation):
                      T b H (34 + 5 nh T / H) on one device; with tensor parallelism T b H (10 + 24/tp + 5 nh T /
                      (H tp)); with sequence parallelism too T b H (34 + 5 nh T / H) / tp; 1F1B keeps up to pp
                      micro-batches in flight on the first stage (lesson 03)
    communication     per device per step, payloads as the lessons measured them: tp 4 all-reduces of [b, T, H] per
                      layer and micro-batch (the same volume as all-gather + reduce-scatter under SP); pp one
                      activation and one gradient [b, T, H] per micro-batch and hop; dp one all-reduce of the
                      gradients held (ZeRO 1-2 the same volume, ZeRO 3 1.5x); a ring all-reduce of N bytes puts
                      2 (n-1)/n N on each device's wire

The plans that fit in device memory are ranked by an estimated step time: the compute (6 Psi FLOPs per token)
stretched by the pipeline bubble (p-1)/(m+p-1), plus the communication (each axis' wire bytes over the bandwidth
of the links it uses: within a node for groups that fit in one, between nodes otherwise), none of it assumed
hidden under compute: a rough upper bound, good for ranking, not for predicting.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    """A GPT of the reference shape. ffn = 0 means 4 x hidden."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0
    tied: bool = False

    @property
    def F(self) -> int:
        return self.ffn or 4 * self.hidden

    def block_params(self) -> tuple[int, int]:
        """(split over tp, replicated) parameters of one transformer block."""
        H, F = self.hidden, self.F
        split = 4 * H * H + 3 * H + 2 * H * F + F  # q, k, v (+ biases), attn proj; fc (+ bias), mlp proj
        replicated = 4 * H + 2 * H  # two LayerNorms; the two row-parallel biases
        return split, replicated

    def params(self) -> int:
        """Psi: every parameter of the model."""
        split, replicated = self.block_params()
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2) + self.seq * self.hidden + 2 * self.hidden
        return self.layers * (split + replicated) + embeddings


@dataclass(frozen=True)
class Cluster:
    devices: int
    memory: float  # bytes per device
    devices_per_node: int = 8
    intra_node_bandwidth: float = 300e9  # bytes/s per device (e.g. NVLink)
    inter_node_bandwidth: float = 25e9  # bytes/s per device (e.g. 200 Gb/s InfiniBand)
    host_bandwidth: float = 25e9  # bytes/s between a device and its host (PCIe), for offload
    flops: float = 300e12  # sustained FLOP/s per device


@dataclass(frozen=True)
class Plan:
    dp: int
    tp: int
    pp: int
    sp: bool = False  # Megatron sequence parallelism (with tp > 1)
    zero: int = 0  # ZeRO stage over the dp axis
    offload: bool = False  # CPU offload of gradients and optimizer states (ZeRO-Offload)

    def __str__(self) -> str:
        extras = [
            name for name, on in (("SP", self.sp), (f"ZeRO-{self.zero}", self.zero), ("offload", self.offload)) if on
        ]
        return f"DP {self.dp} x TP {self.tp} x PP {self.pp}" + "".join(f" + {e}" for e in extras)


@dataclass
class Estimate:
    plan: Plan
    device_bytes: dict[str, float]  # params, grads, optimizer, activations, total
    host_bytes: float
    wire_bytes: dict[str, float]  # per device per step, by axis (and "host" for offload)
    comm_seconds: float  # the communication's estimated time per step
    seconds: float  # the step: compute / (1 - bubble) + communication (none of it hidden: an upper bound)
    fits: bool
    notes: list[str] = field(default_factory=list)


def device_params(model: ModelSpec, tp: int, pp: int) -> int:
    """Parameters held by the busiest device: the pipeline stage with the most (first or last: embeddings or
    head), its big matrices split over tp."""
    split, replicated = model.block_params()
    per_block = split // tp + replicated
    layers = model.layers // pp
    H, V, T = model.hidden, model.vocab, model.seq
    first = V * H // tp + T * H  # wte split by vocabulary, wpe replicated
    last = (0 if model.tied else V * H // tp) + 2 * H  # LM head split by vocabulary, ln_f
    if pp == 1:
        return layers * per_block + first + last
    return layers * per_block + max(first, last)


def model_states(
    psi: float, dp: int, zero: int = 0, offload: bool = False, bytes_per: tuple[float, float, float] = (2, 2, 12)
) -> tuple[dict[str, float], float]:
    """(device bytes of params, grads and optimizer states; host bytes) for Psi parameters on a device.

    ZeRO stage z over dp devices keeps 1/dp of the optimizer states (z >= 1), gradients (z >= 2) and parameters
    (z = 3): the paper's (2 + 2 + K) Psi, 2 Psi + 2 Psi + K Psi / N, 2 Psi + (2 + K) Psi / N, (2 + 2 + K) Psi / N.
    CPU offload (ZeRO-Offload) keeps gradients and optimizer states in host memory instead."""
    p_b, g_b, k_b = bytes_per
    states = {
        "params": p_b * psi / (dp if zero >= 3 else 1),
        "grads": g_b * psi / (dp if zero >= 2 else 1),
        "optimizer": k_b * psi / (dp if zero >= 1 else 1),
    }
    if not offload:
        return states, 0.0
    return {**states, "grads": 0.0, "optimizer": 0.0}, states["grads"] + states["optimizer"]


def activation_bytes(model: ModelSpec, plan: Plan, micro_batch: int, microbatches: int) -> float:
    """Activations the first pipeline stage holds at its peak (Korthikanti et al. 2022; 2-byte activations)."""
    T, H, a, t = model.seq, model.hidden, model.heads, plan.tp
    attention = 5 * a * T / H  # the [T, T] scores and softmax per head
    if t == 1:
        per_layer = 34 + attention
    elif plan.sp:
        per_layer = (34 + attention) / t
    else:
        per_layer = 10 + 24 / t + attention / t
    inflight = min(plan.pp, microbatches)  # 1F1B: the first stage holds up to pp micro-batches
    return T * micro_batch * H * per_layer * (model.layers // plan.pp) * inflight


def estimate(
    model: ModelSpec,
    cluster: Cluster,
    plan: Plan,
    batch: int,
    micro_batch: int = 1,
    bytes_per: tuple[float, float, float] = (2, 2, 12),
) -> Estimate:
    """Memory per device and communication per step of one plan. bytes_per: (param, grad, optimizer) bytes
    per parameter: (2, 2, 12) for mixed-precision Adam, (8, 8, 0) for float64 SGD."""
    p_b, g_b, k_b = bytes_per
    psi = device_params(model, plan.tp, plan.pp)
    states, host = model_states(psi, plan.dp, plan.zero, plan.offload, bytes_per)
    microbatches = batch // (plan.dp * micro_batch)
    device = {**states, "activations": activation_bytes(model, plan, micro_batch, microbatches)}
    device["total"] = sum(device.values())

    e = 2  # bytes of an activation
    bTH = micro_batch * model.seq * model.hidden * e
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731  wire bytes per payload byte of a ring all-reduce
    layers = model.layers // plan.pp
    wire = {
        "tp": 4 * layers * microbatches * bTH * ring(plan.tp) if plan.tp > 1 else 0.0,
        "pp": 2 * microbatches * bTH if plan.pp > 1 else 0.0,
        "dp": g_b * psi * ring(plan.dp) * (1.5 if plan.zero == 3 else 1.0) if plan.dp > 1 else 0.0,
    }
    if plan.offload:
        wire["host"] = (g_b + p_b) * psi / (plan.dp if plan.zero else 1)  # its gradient shard down, parameters up
    per_node = cluster.devices_per_node
    bandwidth = {
        "tp": cluster.intra_node_bandwidth if plan.tp <= per_node else cluster.inter_node_bandwidth,
        "pp": cluster.inter_node_bandwidth if plan.tp * plan.pp > per_node else cluster.intra_node_bandwidth,
        "dp": cluster.inter_node_bandwidth if plan.tp * plan.pp * plan.dp > per_node else cluster.intra_node_bandwidth,
        "host": cluster.host_bandwidth,
    }
    comm_seconds = sum(wire[axis] / bandwidth[axis] for axis in wire)
    # Compute: 6 Psi FLOPs per token (forward 2, backward 4), the batch's tokens shared by every device; the
    # pipeline's bubble (p-1)/(m+p-1) stretches it (lesson 03).
    compute = 6 * model.params() * batch * model.seq / (cluster.devices * cluster.flops)
    bubble = (plan.pp - 1) / (microbatches + plan.pp - 1)
    seconds = compute / (1 - bubble) + comm_seconds
    return Estimate(plan, device, host, wire, comm_seconds, seconds, device["total"] <= cluster.memory)


def divisors(n: int) -> list[int]:
    """The divisors of n, in increasing order (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def plans(model: ModelSpec, cluster: Cluster, batch: int, micro_batch: int = 1, **bytes_per) -> list[Estimate]:
    """Every plan that divides the model and the cluster, estimated: the ones that fit first, by estimated step
    time, then the ones that do not, by how much memory they need."""
    found = []
    # Only divisors can be axis sizes: O(sqrt(devices)) candidates per axis, not devices^2 pairs to test.
    tps = [tp for tp in divisors(cluster.devices) if tp <= cluster.devices_per_node and model.heads % tp == 0]
    for tp in tps:
        for pp in divisors(cluster.devices // tp):
            if model.layers % pp:
                continue
            dp = cluster.devices // (tp * pp)
            if batch % (dp * micro_batch) or batch // (dp * micro_batch) < pp:
                continue  # every replica needs whole micro-batches, at least pp of them for 1F1B
            for sp, zero, offload in itertools.product((False, True), (0, 1, 2, 3), (False, True)):
                if (sp and tp == 1) or (zero and dp == 1) or (offload and zero not in (0, 2)):
                    continue  # SP needs TP; ZeRO shards over dp; offload as ZeRO-Offload (on stage 2) or alone
                plan = Plan(dp, tp, pp, sp, zero, offload)
                found.append(estimate(model, cluster, plan, batch, micro_batch, **bytes_per))
    return sorted(found, key=lambda e: (not e.fits, e.seconds if e.fits else e.device_bytes["total"]))


def describe(e: Estimate) -> str:
    """One line of the planner's table."""
    mem = e.device_bytes
    status = "fits" if e.fits else "too big"
    return (
        f"{str(e.plan):46s} {mem['total'] / GB:8.1f} GB/device ({status}; states "
        f"{(mem['params'] + mem['grads'] + mem['optimizer']) / GB:.1f}, activations {mem['activations'] / GB:.1f}"
        + (f", host {e.host_bytes / GB:.1f}" if e.host_bytes else "")
        + f"), comm {sum(e.wire_bytes.values()) / GB:6.2f} GB/step, step ~ {e.seconds:6.2f} s"
    )
