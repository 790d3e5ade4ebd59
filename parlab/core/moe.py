"""A Mixture-of-Experts feed-forward layer on one device: router, top-k, capacity, load-balancing loss.

An MoE layer replaces a block's MLP by E MLPs ("experts") and a router that sends each token to k of them
(Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021; Mixtral). Parameters grow E times;
the FLOPs per token grow only k times (each token passes through k experts, not E).

For the N = B x T tokens x [N, H] of a step:

    logits = x @ W_r^T                  [N, E]   the router: one linear layer, no bias
    probs  = softmax(logits)            [N, E]
    top-k  -> expert [N, k], p [N, k]            each token's k most likely experts
    gates  = p / p.sum(-1)              [N, k]   renormalised over the chosen k (k = 1: the probability itself, as
                                                 in Switch, or the router would get no gradient from the loss)
    capacity C = ceil(capacity_factor x N x k / E)   slots per expert; the assignments past C are dropped (their
                                                 token passes by on the residual) unless drop=False (no-drop)
    y[i] = sum_j gates[i, j] x expert_{expert[i, j]}(x[i])   over the kept assignments j of token i
    aux  = E x sum_e f_e x P_e          f_e: the share of the N x k assignments routed to e (before drops),
                                        P_e: the mean router probability of e; 1 when balanced (Switch eq. 4)

Who keeps a slot (deterministic): every token's first choice before any token's second choice, and within a
choice, earlier tokens first (GShard's priority), i.e. the queue of expert e is the assignments to e in the order
of expert.T.flatten().

Capacity groups (GShard's G): with `groups=G` the N tokens are cut into G equal blocks of rows, each routed with
its own capacity and its own aux loss (the mean of the G is the layer's aux). That is what G ranks do when each
routes its own B/G rows, so the single-device reference of expert parallelism on P ranks uses groups=P.
Groups along the sequence too (`seq_groups`): a context-parallel rank holds only some positions of its rows, so
its group is its rows x its positions; `seq_groups` lists the positions of each of C equal sequence blocks (a
partition of range(T)), and group (g, c) is the tokens of row block g at the positions of block c, row-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class MoEConfig:
    experts: int = 4  # E
    top_k: int = 2  # k
    capacity_factor: float = 1.25
    drop: bool = True  # False: no-drop mode, every expert takes every token sent to it
    aux_weight: float = 0.01  # the load-balancing loss' weight in the training loss
    every: int = 1  # an MoE layer in every block (1) or every other block (2: blocks 1, 3, ...)
    groups: int = 1  # capacity groups (see the module docstring): P for the reference of P expert-parallel ranks
    seq_groups: tuple[tuple[int, ...], ...] = ()  # positions of each sequence block of a group (): the whole row

    def __post_init__(self):
        check_moe(self.experts, self.top_k, self.capacity_factor)
        if self.every < 1 or self.groups < 1:
            raise ValueError(f"every={self.every} and groups={self.groups} must be >= 1")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has an MoE FFN: every block (every=1) or blocks every-1, 2*every-1, ..."""
        return layer % self.every == self.every - 1


def check_moe(experts: int, top_k: int, capacity_factor: float, world_size: int = 1) -> None:
    """Raise a clear ValueError for an MoE that cannot be built (or spread over `world_size` ranks)."""
    if experts < 1:
        raise ValueError(f"experts={experts} must be >= 1")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and experts={experts} (a token picks k distinct experts)")
    if not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (1.0: exactly N x k / E slots per expert)")
    if experts % world_size:
        raise ValueError(
            f"experts={experts} is not divisible by the {world_size} expert-parallel ranks: each rank holds E / P "
            "whole experts"
        )


def capacity(tokens: int, cfg: MoEConfig) -> int:
    """Slots per expert for `tokens` tokens: ceil(capacity_factor x tokens x k / E); every assignment if no-drop."""
    if not cfg.drop:
        return tokens * cfg.top_k
    return math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.experts)


class Expert(nn.Module):
    """One expert: the reference GPT's MLP, H -> F -> H."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn)
        self.proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        return self.proj(F.gelu(self.fc(x)))


@dataclass
class Routing:
    """Where one group's tokens go. N tokens, k choices each."""

    expert: torch.Tensor  # [N, k] int64: each token's chosen experts, most likely first
    gates: torch.Tensor  # [N, k]: their weights (differentiable)
    keep: torch.Tensor  # [N, k] bool: the assignment got a slot (False: dropped for capacity)
    aux: torch.Tensor  # scalar: the load-balancing loss E x sum_e f_e P_e
    load: torch.Tensor  # [E] int64: assignments routed to each expert (before drops)


def route(x: torch.Tensor, router: nn.Linear, cfg: MoEConfig) -> Routing:
    """Route one group of tokens x [N, H]: top-k, renormalised gates, capacity drops, aux loss."""
    N, E, k = x.shape[0], cfg.experts, cfg.top_k
    probs = router(x).softmax(dim=-1)  # [N, E]
    p, expert = probs.topk(k, dim=-1)  # [N, k] each, most likely first
    gates = p / p.sum(dim=-1, keepdim=True) if k > 1 else p
    # Each expert's queue: first choices, then second choices; earlier tokens first within a choice.
    queue = expert.T.reshape(-1)  # [k * N]: choice-major order
    onehot = F.one_hot(queue, E)  # [k * N, E]
    slot = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=-1)  # position of each assignment in its expert's queue
    keep = (slot < capacity(N, cfg)).reshape(k, N).T  # [N, k]
    load = onehot.sum(dim=0)  # [E]
    f = load.to(x.dtype) / (N * k)  # [E] share of the assignments (not differentiable: counts)
    aux = E * (f * probs.mean(dim=0)).sum()
    return Routing(expert, gates, keep, aux, load)


class MoE(nn.Module):
    """The MoE feed-forward layer, on one device. [B, T, H] -> [B, T, H].

    After each forward it keeps `aux_loss` (differentiable, weight not applied) and `stats` (load per expert,
    dropped assignments) for the training loop and the reports.
    """

    def __init__(self, hidden: int, ffn: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(hidden, cfg.experts, bias=False)  # W_r [E, H]
        self.experts = nn.ModuleDict({str(e): Expert(hidden, ffn) for e in range(cfg.experts)})  # name = global id
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        groups, order = self.groups(B), self.sequence_order(T)  # G row blocks; C sequence blocks side by side
        C = len(self.cfg.seq_groups) or 1
        blocks = x[:, order.to(x.device)].view(groups, B // groups, C, T // C, H).transpose(1, 2)  # [G, C, B/G, T/C, H]
        xg = blocks.reshape(groups * C, -1, H)  # [G C, N/(G C), H]: group (g, c) = rows of block g at positions of c
        outs, routings = [], []
        for xs in xg:
            routing = route(xs, self.router, self.cfg)
            outs.append(self.run_experts(xs, routing))
            routings.append(routing)
        self.aux_loss = torch.stack([r.aux for r in routings]).mean()
        self.stats = {
            "load": sum(r.load for r in routings).tolist(),  # [E]
            "dropped": int(sum((~r.keep).sum() for r in routings)),
            "assignments": x.shape[0] * T * self.cfg.top_k,
        }
        out = torch.stack(outs).view(groups, C, B // groups, T // C, H).transpose(1, 2).reshape(B, T, H)
        return out[:, torch.argsort(order).to(x.device)]  # back to the sequence's own order

    def sequence_order(self, seq: int) -> torch.Tensor:
        """The positions [T] with each sequence group's side by side (arange(T) without seq_groups)."""
        blocks = self.cfg.seq_groups or (tuple(range(seq)),)
        order = torch.tensor([t for block in blocks for t in block])  # host: indices, moved where they are used
        if sorted(order.tolist()) != list(range(seq)) or len({len(b) for b in blocks}) != 1:
            raise ValueError(f"seq_groups={blocks} is not a partition of range({seq}) into equal blocks")
        return order

    def groups(self, batch: int) -> int:
        """How many capacity groups this layer cuts its batch into (an expert-parallel layer: always 1)."""
        if batch % self.cfg.groups:
            raise ValueError(f"batch={batch} is not divisible by the MoE's capacity groups={self.cfg.groups}")
        return self.cfg.groups

    def run_experts(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every expert on its kept tokens, gate-weighted and summed per token. x [N, H] -> [N, H]."""
        token, choice = routing.keep.nonzero(as_tuple=True)  # the kept assignments, token-major
        out = torch.zeros_like(x)
        for name, expert in self.experts.items():
            mine = routing.expert[token, choice] == int(name)
            t, c = token[mine], choice[mine]
            y = expert(x[t])  # [n_e, H]
            out = out.index_add(0, t, routing.gates[t, c].unsqueeze(-1) * y)
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of a model, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The weighted load-balancing loss of the model's last forward: aux_weight x sum over its MoE layers."""
    layers = moe_layers(model)
    if not layers:
        return 0.0
    return layers[0].cfg.aux_weight * sum(m.aux_loss for m in layers)


def moe_param_counts(hidden: int, ffn: int, cfg: MoEConfig) -> dict:
    """Parameters of one MoE layer, and those a token uses (why MoE: the first grows with E, the second with k)."""
    expert = 2 * hidden * ffn + ffn + hidden
    router = hidden * cfg.experts
    return {"total": cfg.experts * expert + router, "active": cfg.top_k * expert + router, "dense_mlp": expert}
