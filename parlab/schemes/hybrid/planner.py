"""A planner: for a model, a cluster and a batch, which combination of parallelism fits, and which talks least.

Every formula here is one a lesson measured at small size:

    parameters        Psi = L (4H^2 + 4H + 2HF + F + H + 4H) + V H (x2 untied) + T H + 2H        (the reference GPT)
    per device        a pipeline stage's blocks (L / pp of them; the first and last stage add the embeddings and
                      the head), their big matrices split over tp, LayerNorms and row-parallel biases replicated
    model states      params, grads, optimizer states: p + g + K bytes per parameter (mixed precision: 2 + 2 + 12);
                      ZeRO stage z over the dp axis divides the optimizer (z >= 1), grads (z >= 2), params (z = 3)
                      by dp (lesson 05); CPU offload moves grads and optimizer states to host memory (lesson 06)
    activations       per layer and micro-batch, the terms Korthikanti et al. 2022 count, for a GPT without dropout
                      (parlab/schemes/recompute/measure.py, `activation_terms`: what autograd keeps, measured term by
                      term) at 2 bytes a number: about T b H (8 + 2F/H) + nh T^2 b on one device; tensor parallelism
                      splits the heads' and the FFN's terms over tp, sequence parallelism the LayerNorms' too;
                      recompute="selective" drops the nh T^2 b scores, "full" keeps only the block input T b H;
                      context parallelism holds T/cp tokens (ring attention keeps its output and log-sum-exp
                      instead of the scores; Ulysses the scores of nh/cp heads over all T); the last stage adds the
                      final LayerNorm, the LM head's input and the [b, T, V/tp] softmax; 1F1B keeps up to pp
                      micro-batches in flight on the first stage (lesson 03)
    experts (MoE)     E experts of 2HF + F + H parameters and an [E, H] router in each block instead of the MLP;
                      expert parallelism keeps E/ep experts per device (ep divides dp x cp, as in torchtitan), and
                      each MoE layer's all-to-all carries tokens x k x H numbers each way, (ep-1)/ep of them off the
                      device, dispatch and combine, forward and backward
    communication     per device per step, payloads as the lessons measured them: tp 4 all-reduces of [b, T/cp, H]
                      per layer and micro-batch (the same volume as all-gather + reduce-scatter under SP); cp
                      (ring) 3cp - 2 K/V blocks [2, b, nh/tp, T/cp, hs] per layer and micro-batch (Ulysses: 8
                      all-to-alls of [b, nh/tp, T/cp, hs]); pp one activation and one gradient [b, T/cp, H] per
                      micro-batch and hop; dp one all-reduce over dp x cp of the gradients held (ZeRO 1-2 the
                      same volume, ZeRO 3 1.5x); a ring all-reduce of N bytes puts 2 (n-1)/n N on each device's
                      wire
    model states      one formula, ZeRO's (parlab/schemes/zero/theory.py, `zero_memory`), over the dp x cp ranks that
                      hold the same weights (expert weights: over dp x cp / ep)

The plans that fit in device memory are ranked by an estimated step time: the compute (6 Psi FLOPs per token)
stretched by the pipeline bubble (p-1)/(m+p-1), plus the communication (each axis' wire bytes over the bandwidth
of the links it uses: within a node for groups that fit in one, between nodes otherwise), none of it assumed
hidden under compute except the pipeline's sends, which count as the hops 1F1B waits for (`pipeline_seconds`). Its
clock is parlab.core.hardware's, the one a paced run keeps.

Checked once on real hardware (issue 38: one H200, torch 2.11 + CUDA 13.0, bf16): the reference GPT's training step
ran at 362-407 TFLOP/s, and hardware.profile("h100") (989 TFLOP/s x efficiency 0.4 = 396 TFLOP/s; an H200 computes
like an H100, with more and faster memory) predicted its step time within 9%: measured / predicted 0.97 and 1.09,
for the two model shapes measured. Those shapes were not recorded with the figures; the next GPU run should note
them beside its own measurement (benchmarks/gpu_check.sh). One GPU, so this checks the compute term only, not the
links'.
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
    experts: int = 0  # E experts per block instead of the MLP (0: a dense model)
    top_k: int = 1  # k experts per token

    @property
    def F(self) -> int:
        return self.ffn or 4 * self.hidden

    def block_params(self) -> tuple[int, int]:
        """(split over tp, replicated) parameters of one transformer block, its experts left out."""
        H, F = self.hidden, self.F
        split = 4 * H * H + 3 * H  # q, k, v (+ biases), attn proj
        replicated = 4 * H + H  # two LayerNorms; the attention's row-parallel bias
        if not self.experts:
            split, replicated = split + 2 * H * F + F, replicated + H  # fc (+ bias), mlp proj (+ bias)
        else:
            replicated += H * self.experts  # the router [E, H]
        return split, replicated

    def expert_params(self) -> int:
        """Parameters of one block's E experts (each an MLP: fc, proj and their biases)."""
        return self.experts * (2 * self.hidden * self.F + self.F + self.hidden)

    def params(self) -> int:
        """Psi: every parameter of the model."""
        split, replicated = self.block_params()
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2) + self.seq * self.hidden + 2 * self.hidden
        return self.layers * (split + replicated + self.expert_params()) + embeddings

    def active_params(self) -> int:
        """Parameters a token uses: with experts, k of the E (what the compute grows with)."""
        if not self.experts:
            return self.params()
        return self.params() - self.layers * self.expert_params() * (self.experts - self.top_k) // self.experts


@dataclass(frozen=True)
class Cluster:
    devices: int
    memory: float  # bytes per device
    devices_per_node: int = 8
    intra_node_bandwidth: float = 300e9  # bytes/s per device (e.g. NVLink)
    inter_node_bandwidth: float = 25e9  # bytes/s per device (e.g. 200 Gb/s InfiniBand)
    host_bandwidth: float = 25e9  # bytes/s between a device and its host (PCIe), for offload
    flops: float = 300e12  # sustained FLOP/s per device
    intra_node_alpha: float = 0.0  # seconds of latency per message inside a node
    inter_node_alpha: float = 0.0  # ... and between nodes

    @classmethod
    def from_profile(cls, name: str, devices: int, memory: float = 80e9) -> Cluster:
        """A cluster of the named GPU (parlab.core.hardware, the model of time parlab.core.pace uses too): its sustained
        FLOP/s (peak x efficiency), NVLink inside a node and InfiniBand across, each alpha + bytes / bandwidth."""
        from parlab.core.hardware import profile

        hw = profile(name)
        return cls(
            devices,
            memory,
            hw.gpus_per_node,
            hw.nvlink_bandwidth,
            hw.ib_bandwidth,
            flops=hw.peak_flops * hw.efficiency,
            intra_node_alpha=hw.nvlink_alpha,
            inter_node_alpha=hw.ib_alpha,
        )


@dataclass(frozen=True)
class Plan:
    dp: int
    tp: int
    pp: int
    sp: bool = False  # Megatron sequence parallelism (with tp > 1)
    zero: int = 0  # ZeRO stage over the dp (x cp) ranks
    offload: bool = False  # CPU offload of gradients and optimizer states (ZeRO-Offload)
    cp: int = 1  # context parallelism: T/cp tokens of every sequence per device
    ep: int = 1  # expert parallelism: E/ep experts per device (ep divides dp x cp)
    recompute: str = "none"  # activation recomputation: none, selective or full
    cp_method: str = "ring"  # ring (or zigzag: the same memory and bytes) or ulysses

    def __str__(self) -> str:
        axes = f"DP {self.dp} x TP {self.tp} x PP {self.pp}" + (f" x CP {self.cp}" if self.cp > 1 else "")
        extras = [
            name
            for name, on in (
                (f"EP {self.ep}", self.ep > 1),
                ("SP", self.sp),
                (f"ZeRO-{self.zero}", self.zero),
                ("offload", self.offload),
                (f"recompute {self.recompute}", self.recompute != "none"),
            )
            if on
        ]
        return axes + "".join(f" + {e}" for e in extras)


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

    ZeRO's table (parlab/schemes/zero/theory.py, `zero_memory`, the formula's one home) over the dp devices that hold
    the same weights: stage z keeps 1/dp of the optimizer states (z >= 1), gradients (z >= 2) and parameters (z = 3).
    CPU offload (ZeRO-Offload) keeps gradients and optimizer states in host memory instead."""
    from parlab.schemes.zero.theory import zero_memory

    p_b, g_b, k_b = bytes_per
    row = zero_memory(psi, dp, K=k_b, param_bytes=p_b, grad_bytes=g_b)[zero]
    states = {k: row[k] for k in ("params", "grads", "optimizer")}
    if not offload:
        return states, 0.0
    return {**states, "grads": 0.0, "optimizer": 0.0}, states["grads"] + states["optimizer"]


def layer_activation_bytes(
    model: ModelSpec, plan: Plan, micro_batch: int, dtype_bytes: float = 2, sp_keeps_gathered: bool = False
) -> float:
    """Bytes one device keeps for one layer's backward, per micro-batch: parlab/schemes/recompute/measure.py's terms
    (what autograd keeps of the reference GPT, no dropout) on this device's T/cp tokens, its heads and FFN columns
    split over tp (and with SP its LayerNorm regions), less what `plan.recompute` drops; with cp > 1 attention
    keeps ring attention's output and log-sum-exp, or Ulysses' scores of nh/(tp cp) heads over all T.
    SP as Megatron-LM keeps it: the T/tp shard of the column-parallel layers' input, gathered again in the
    backward; sp_keeps_gathered: as parlab's SP keeps it (the gathered [b, T, H], three copies for q, k, v)."""
    from types import SimpleNamespace

    from parlab.schemes.recompute.theory import activation_terms

    t, cp, D = plan.tp, plan.cp, dtype_bytes
    s, b, h, a = model.seq // cp, micro_batch, model.hidden, model.heads
    local = SimpleNamespace(dtype_bytes=D, seq_len=s, hidden=h, heads=a, ffn=model.F)
    parallel = "none" if t == 1 else ("tp+sp" if plan.sp else "tp")
    terms = activation_terms(local, b, plan.recompute, parallel, t)
    if plan.sp and not sp_keeps_gathered and plan.recompute != "full":
        terms["QKV input (LN1 output)"] = terms["fc input (LN2 output)"] = D * s * b * h / t
    if cp > 1 and plan.recompute == "none":
        terms.pop("softmax output"), terms.pop("causal mask (bool)")  # the [T/cp, T/cp] scores are not kept
        if plan.cp_method == "ulysses":  # nh/(tp cp) heads over all T tokens
            terms["softmax output"], terms["causal mask (bool)"] = D * a * model.seq**2 * b / (t * cp), model.seq**2
        else:  # the ring keeps its output and the log-sum-exp of each query row
            terms["ring output"], terms["ring log-sum-exp"] = D * s * b * h / t, D * a * s * b / t
    if model.experts and plan.recompute != "full":  # the MLP's terms, for the k rows each token becomes
        terms["fc input (LN2 output)"] *= model.top_k
        for name in ("GeLU input", "fc2 input (GeLU output)"):
            terms[name] *= model.top_k * t  # k rows per token; the experts are not split over tp
    return sum(terms.values())


def head_activation_bytes(model: ModelSpec, plan: Plan, micro_batch: int, dtype_bytes: float = 2) -> float:
    """The last stage's extra per micro-batch: ln_f's input and statistics, the LM head's input and the
    [b, T/cp, V/tp] softmax the loss keeps."""
    t, D = plan.tp, dtype_bytes
    sb, ln = model.seq // plan.cp * micro_batch, (plan.tp if plan.sp else 1)
    return D * sb * (model.hidden / ln + 2 / ln + model.hidden + model.vocab / t)


def activation_bytes(
    model: ModelSpec,
    plan: Plan,
    micro_batch: int,
    microbatches: int,
    dtype_bytes: float = 2,
    sp_keeps_gathered: bool = False,
) -> float:
    """Activations the busiest pipeline stage holds at its peak: the first holds up to pp micro-batches in
    flight (1F1B, lesson 03), the last one and the head's."""
    per_layer = layer_activation_bytes(model, plan, micro_batch, dtype_bytes, sp_keeps_gathered)
    blocks = per_layer * (model.layers // plan.pp)
    head = head_activation_bytes(model, plan, micro_batch, dtype_bytes)
    if plan.pp == 1:
        return blocks + head
    return max(blocks * min(plan.pp, microbatches), blocks + head)


def forward_flops(model: ModelSpec, sequences: int) -> float:
    """FLOPs of a forward over `sequences` x T tokens: parlab.core.hardware.gpt_forward_flops (the count paced runs
    use), with a token's k experts' MLPs in place of the dense one."""
    from types import SimpleNamespace

    from parlab.core.hardware import gpt_forward_flops

    F = model.F * (model.top_k if model.experts else 1)  # k expert MLPs per token: k x the FLOPs of one
    cfg = SimpleNamespace(layers=model.layers, hidden=model.hidden, ffn=F, seq_len=model.seq, vocab_size=model.vocab)
    return gpt_forward_flops(cfg, sequences)


def recompute_factor(model: ModelSpec, recompute: str) -> float:
    """Compute of a step with recomputation over without: full runs each block's forward again (+1/3 of the
    6 Psi per token), selective the attention core's 4 T H FLOPs per token and layer."""
    if recompute == "full":
        return 4 / 3
    if recompute == "selective":
        per_token = 6 * model.active_params() / model.layers  # FLOPs per token and layer, forward and backward
        return 1 + 4 * model.seq * model.hidden / per_token
    return 1.0


def pipeline_seconds(compute: float, p: int, m: int, hop: float) -> float:
    """One step's compute (seconds: all micro-batches, forward and backward) run as 1F1B over p stages, each
    message between two stages taking `hop` seconds: compute / (1 - bubble), bubble = (p-1)/(m+p-1), plus the
    hops a stage waits for. In 1F1B's steady state a stage's next backward waits for a round trip (2 hops) of
    the micro-batch ahead of it, and (p-1)/p of the m+p-1 slots of the timeline wait so: 2 (p-1)/p (m+p-1) hops.
    (parlab/schemes/pipeline/schedules.py's exact simulation with a hop, `simulate(..., hop=)`, agrees within 15% for B
    = 2F and hops shorter than a forward; tests/test_planner.py checks it.)"""
    if p == 1:
        return compute
    return compute * (m + p - 1) / m + 2 * (p - 1) / p * (m + p - 1) * hop


def estimate(
    model: ModelSpec,
    cluster: Cluster,
    plan: Plan,
    batch: int,
    micro_batch: int = 1,
    bytes_per: tuple[float, float, float] = (2, 2, 12),
    activation_bytes_per: float = 2,
    sp_keeps_gathered: bool = False,
) -> Estimate:
    """Memory per device and communication per step of one plan. bytes_per: (param, grad, optimizer) bytes
    per parameter: (2, 2, 12) for mixed-precision Adam, (8, 8, 0) for float64 SGD; activation_bytes_per: bytes
    of an activation (2; 8 for the float64 runs); sp_keeps_gathered: count SP's activations as parlab keeps them
    (for its live runs), not as Megatron-LM does."""
    p_b, g_b, k_b = bytes_per
    shard = plan.dp * plan.cp  # the devices holding the same weights: ZeRO and the gradient reduction span them
    psi = device_params(model, plan.tp, plan.pp)
    experts = model.expert_params() * (model.layers // plan.pp) / plan.ep  # E/ep experts per MoE layer
    states, host = model_states(psi, shard, plan.zero, plan.offload, bytes_per)
    if experts:
        more, more_host = model_states(experts, shard // plan.ep, plan.zero, plan.offload, bytes_per)
        states, host = {k: states[k] + more[k] for k in states}, host + more_host
    microbatches = batch // (plan.dp * micro_batch)
    acts = activation_bytes(model, plan, micro_batch, microbatches, activation_bytes_per, sp_keeps_gathered)
    device = {**states, "activations": acts}
    device["total"] = sum(device.values())

    e = 2  # bytes of an activation on the wire
    bTH = micro_batch * model.seq // plan.cp * model.hidden * e  # [b, T/cp, H]
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731  wire bytes per payload byte of a ring all-reduce
    layers = model.layers // plan.pp
    cp_block = bTH / plan.tp  # [b, nh/tp, T/cp, hs]: a q, k, v or output block of this device's heads
    cp_wire = (
        (8 * cp_block * (plan.cp - 1) / plan.cp) if plan.cp_method == "ulysses" else (3 * plan.cp - 2) * 2 * cp_block
    )
    wire = {
        "tp": 4 * layers * microbatches * bTH * ring(plan.tp) if plan.tp > 1 else 0.0,
        "cp": layers * microbatches * cp_wire if plan.cp > 1 else 0.0,
        "pp": 2 * microbatches * bTH / (plan.tp if plan.sp else 1) if plan.pp > 1 else 0.0,
        "dp": g_b * psi * ring(shard) * (1.5 if plan.zero == 3 else 1.0) if shard > 1 else 0.0,
    }
    if experts:  # dispatch and combine, forward and backward: tokens x k rows of H each, (ep-1)/ep leave
        wire["ep"] = 4 * layers * microbatches * bTH * model.top_k * (plan.ep - 1) / plan.ep
        if shard // plan.ep > 1:
            wire["dp"] += g_b * experts * ring(shard // plan.ep) * (1.5 if plan.zero == 3 else 1.0)
    if plan.offload:
        wire["host"] = (g_b + p_b) * (psi + experts) / (shard if plan.zero else 1)  # gradients down, params up
    per_node = cluster.devices_per_node
    inside = lambda n: cluster.intra_node_bandwidth if n <= per_node else cluster.inter_node_bandwidth  # noqa: E731
    tp, cp = plan.tp, plan.cp  # mesh order pp, dp, cp, tp (tp fastest): an axis' group spans the axes after it
    bandwidth = {
        "tp": inside(tp),
        "cp": inside(tp * cp),
        "ep": inside(tp * cp * plan.ep),
        "dp": inside(tp * cp * plan.dp),
        "pp": inside(tp * cp * plan.dp * plan.pp),
        "host": cluster.host_bandwidth,
    }
    # Every axis' bytes take their time, except the pipeline's: its sends overlap the next micro-batch's compute,
    # and only the fill and the drain wait for them (below).
    comm_seconds = sum(wire[axis] / bandwidth[axis] for axis in wire if axis != "pp")
    # Latency: alpha per message on the axes whose messages are many and small (tp, cp, pp, per micro-batch).
    intra = lambda n: cluster.intra_node_alpha if n <= per_node else cluster.inter_node_alpha  # noqa: E731
    cp_calls = 8 if plan.cp_method == "ulysses" else 3 * plan.cp - 2  # per layer and micro-batch
    messages = {
        "tp": 4 * layers * microbatches * (plan.tp > 1),
        "cp": layers * microbatches * cp_calls * (plan.cp > 1),
    }
    spans = {"tp": tp, "cp": tp * cp}
    comm_seconds += sum(n * intra(spans[axis]) for axis, n in messages.items())
    hop = 0.0
    if plan.pp > 1:  # one activation (or its gradient) of one micro-batch between two stages
        hop = intra(tp * cp * plan.dp * plan.pp) + wire["pp"] / (2 * microbatches) / bandwidth["pp"]
    # Compute: 3 forwards' FLOPs (backward = 2 forwards): 2 per weight a token uses and 4 T H per layer for its
    # attention scores (parlab.core.hardware's count), the batch's tokens shared by every device, more with
    # recomputation; the pipeline's bubble (p-1)/(m+p-1) stretches it.
    compute = 3 * forward_flops(model, batch) / (cluster.devices * cluster.flops)
    compute *= recompute_factor(model, plan.recompute)
    seconds = pipeline_seconds(compute, plan.pp, microbatches, hop) + comm_seconds
    return Estimate(plan, device, host, wire, comm_seconds, seconds, device["total"] <= cluster.memory)


def divisors(n: int) -> list[int]:
    """The divisors of n, in increasing order (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def plans(
    model: ModelSpec,
    cluster: Cluster,
    batch: int,
    micro_batch: int = 1,
    *,
    cps: tuple[int, ...] = (1,),
    recomputes: tuple[str, ...] = ("none",),
    **bytes_per,
) -> list[Estimate]:
    """Every plan that divides the model and the cluster, estimated: the ones that fit first, by estimated step
    time, then the ones that do not, by how much memory they need. cps: the context-parallel sizes to try (each
    must divide the sequence); recomputes: the recomputation modes to try; with experts, every ep that divides
    both dp x cp and E."""
    found = []
    # Only divisors can be axis sizes: O(sqrt(devices)) candidates per axis, not devices^2 pairs to test.
    tps = [tp for tp in divisors(cluster.devices) if tp <= cluster.devices_per_node and model.heads % tp == 0]
    for tp, cp in itertools.product(tps, cps):
        if cluster.devices % (tp * cp) or model.seq % cp:
            continue
        for pp in divisors(cluster.devices // (tp * cp)):
            if model.layers % pp:
                continue
            dp = cluster.devices // (tp * cp * pp)
            if batch % (dp * micro_batch) or batch // (dp * micro_batch) < pp:
                continue  # every replica needs whole micro-batches, at least pp of them for 1F1B
            eps = [ep for ep in divisors(dp * cp) if model.experts % ep == 0] if model.experts else [1]
            options = itertools.product((False, True), (0, 1, 2, 3), (False, True), eps, recomputes)
            for sp, zero, offload, ep, recompute in options:
                if (sp and tp == 1) or (zero and dp * cp == 1) or (offload and zero not in (0, 2)):
                    continue  # SP needs TP; ZeRO shards over dp x cp; offload as ZeRO-Offload (stage 2) or alone
                plan = Plan(dp, tp, pp, sp, zero, offload, cp, ep, recompute)
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
