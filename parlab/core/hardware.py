"""One model of time: named hardware profiles, shared by the paced runs (parlab.core.pace) and the planner.

A profile says how long compute and communication take on a real GPU cluster:

    compute_seconds(flops)                   flops / (peak FLOP/s x efficiency)
    link_seconds(nbytes, intra_node=True)    alpha + nbytes / bandwidth   (NVLink inside a node, InfiniBand across)

    from parlab.core import hardware
    h100 = hardware.profile("h100")
    h100.compute_seconds(2 * 7e9 * 4096)          # one forward of a 7B model over 4096 tokens: ~0.14 s
    h100.link_seconds(64 << 20, intra_node=False) # a 64 MiB message to another node: ~1.35 ms

The numbers, and where they come from (dense bf16, per GPU, one direction):
    H100 SXM5   989 TFLOP/s        NVIDIA H100 Tensor Core GPU datasheet (1,979 TFLOP/s "with sparsity", halved)
                NVLink 4: 450 GB/s NVIDIA: 900 GB/s total per GPU (18 links x 50 GB/s, both directions)
                InfiniBand NDR: 50 GB/s   one ConnectX-7 400 Gb/s port per GPU (DGX H100 / HGX H100 reference)
    A100 SXM4   312 TFLOP/s        NVIDIA A100 Tensor Core GPU datasheet (624 "with sparsity", halved)
                NVLink 3: 300 GB/s NVIDIA: 600 GB/s total per GPU (12 links x 50 GB/s, both directions)
                InfiniBand HDR: 25 GB/s   one ConnectX-6 200 Gb/s port per GPU (DGX A100 reference)
    efficiency  0.4                the model FLOPs utilisation large runs report: PaLM 46.2% (Chowdhery et al.
                                   2022), Llama 3 405B 38-43% on H100 (Dubey et al. 2024); an assumption, editable
    alpha       NVLink 5 us, InfiniBand 10 us: the order of NCCL's small-message latency (an assumption; NCCL's
                own tuning model uses a few microseconds per hop)

Peak bandwidths are what the links carry at best; a collective reaches less (its algorithm's bus bandwidth).
Change any number with `dataclasses.replace(profile("h100"), efficiency=0.5)`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """A GPU and its links. FLOP/s and bytes/s per GPU; alpha in seconds per message."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    efficiency: float  # the fraction of peak a training step sustains (model FLOPs utilisation)
    nvlink_bandwidth: float  # bytes/s, one direction, inside a node
    nvlink_alpha: float
    ib_bandwidth: float  # bytes/s, one direction, per GPU, across nodes
    ib_alpha: float
    gpus_per_node: int = 8

    def compute_seconds(self, flops: float) -> float:
        """Time of `flops` floating-point operations at peak x efficiency."""
        return flops / (self.peak_flops * self.efficiency)

    def link_seconds(self, nbytes: float, intra_node: bool = True) -> float:
        """Time of one message of `nbytes`: alpha + nbytes / bandwidth, over NVLink (intra_node) or InfiniBand."""
        if intra_node:
            return self.nvlink_alpha + nbytes / self.nvlink_bandwidth
        return self.ib_alpha + nbytes / self.ib_bandwidth

    def describe(self) -> str:
        return (
            f"{self.name.upper()}: {self.peak_flops / 1e12:g} TFLOP/s x {self.efficiency:g}; NVLink "
            f"{self.nvlink_bandwidth / 1e9:g} GB/s + {self.nvlink_alpha * 1e6:g} us; InfiniBand "
            f"{self.ib_bandwidth / 1e9:g} GB/s + {self.ib_alpha * 1e6:g} us"
        )


PROFILES = {
    "h100": Profile("h100", 989e12, 0.4, 450e9, 5e-6, 50e9, 10e-6),
    "a100": Profile("a100", 312e12, 0.4, 300e9, 5e-6, 25e9, 10e-6),
}


def profile(name: str) -> Profile:
    """The named profile ("h100", "a100"); ValueError naming the known ones otherwise."""
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; one of {', '.join(PROFILES)}")
    return PROFILES[name]


def gpt_forward_flops(cfg, sequences: int, layers: int | None = None, head: bool = True) -> float:
    """FLOPs of a forward of the reference GPT (parlab.core.models.GPTConfig) over `sequences` x T tokens, through
    `layers` of its blocks (default all) and, with head=True, the LM head: 2 FLOPs per multiply-add.

    Per token and block: 2 x (4 H^2 attention projections + 2 H F MLP) for the weights, + 2 x 2 T H for the
    attention scores and the weighted sum (Kaplan et al. 2020's count, with the full T x T score matrix);
    LM head 2 H V. Backward is twice the forward (the unit costs of parlab.core.pace: B = 2F).
    """
    layers = cfg.layers if layers is None else layers
    ffn = cfg.ffn or 4 * cfg.hidden
    per_token = layers * (2 * (4 * cfg.hidden**2 + 2 * cfg.hidden * ffn) + 4 * cfg.seq_len * cfg.hidden)
    per_token += 2 * cfg.hidden * cfg.vocab_size if head else 0
    return float(per_token * sequences * cfg.seq_len)
