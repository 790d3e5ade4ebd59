"""Expert parallelism (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): the experts of an MoE layer
spread over the ranks of a group, tokens shuffled to them and back by two all-to-alls.

The MoE layer itself (router, top-k, capacity, aux loss) is parlab/core/moe.py. Here, on P ranks of the ep group:

    rank r holds the router and every dense weight (replicated), and experts [r*E/P, (r+1)*E/P) only
    rank r routes its own tokens (its B/P rows of the batch: one capacity group), then per MoE layer:

    1. counts:   all_to_all of the [E] counts of tokens it sends to each expert (8 bytes each): afterwards
                 each rank knows how many rows it will receive from each rank for each of its experts
    2. dispatch: sort the kept assignments by expert (hence by owner rank); all_to_all_single with uneven
                 split sizes: send_splits[s] rows to rank s, recv_splits[s] rows from rank s
    3. experts:  each local expert runs once on all the rows it received, from every rank
    4. combine:  the reverse all_to_all_single (the splits swapped) brings each row home; the token's output is
                 the gate-weighted sum of its k expert outputs
    backward:    the same two all-to-alls in reverse (AllToAll's backward), so both directions show on the trace

Payload per rank per MoE layer per step (S rows sent, R received, H hidden, e bytes per number):
    counts E x 8,  dispatch S x H x e,  combine R x H x e,  and backward the same two again: 2 (S + R) H e + 8 E
    balanced router, no drops: S = R = N k (N = this rank's tokens), of which (P-1)/P leaves the rank

With data parallelism (DeviceMesh {"dp": D, "ep": P}, W = D x P ranks, every rank with its own B/W rows):
dense gradients are all-reduced over all W ranks; an expert's gradient already sums the tokens of its ep group
(the backward all-to-all brought them), so it is all-reduced over the dp axis (its D replicas) only; both / W.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parlab.core import comm
from parlab.core.mesh import DeviceMesh
from parlab.core.models import GPT, lm_loss, make_optimizer
from parlab.core.moe import MoE, Routing, aux_loss, capacity, moe_layers
from parlab.schemes.data_parallel import shard_batch


def local_experts(experts: int, world_size: int, rank: int) -> range:
    """The global ids of the experts rank `rank` of the ep group holds: [r*E/P, (r+1)*E/P)."""
    per_rank = experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def is_expert_param(name: str) -> bool:
    """Whether a parameter belongs to an expert (sharded over ep) rather than to the dense model (replicated)."""
    return ".experts." in name


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the reverse shuffle (the splits swapped).

    x: [sum(in_splits), H], rows [sum(in_splits[:s]), ...) go to rank s -> [sum(out_splits), H] from each rank.
    """

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, label):
        ctx.splits, ctx.group, ctx.label = (out_splits, in_splits), group, label
        out = x.new_empty(sum(out_splits), x.shape[1])
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, label=f"{label} fwd")
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), grad.shape[1])
        comm.all_to_all_single(
            grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group, label=f"{ctx.label} bwd"
        )
        return grad_in, None, None, None, None


def exchange_counts(send_counts: torch.Tensor, group=None, label: str = "counts") -> torch.Tensor:
    """The small all-to-all: send_counts [E] (rows for each expert) -> [P, E/P]: row s = rank s's rows for
    each of my experts."""
    P = comm.group_size(group)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all_single(recv_counts, send_counts, group=group, label=label)  # chunk r of [E] goes to rank r
    return recv_counts.view(P, -1)


class ExpertParallelMoE(MoE):
    """An MoE layer whose experts are spread over the ranks of `group`: this rank keeps E/P of them.

    Built from the full layer (the same weights on every rank): the router stays, the other experts go.
    """

    def __init__(self, full: MoE, group=None, label: str = "moe"):
        nn.Module.__init__(self)
        self.cfg, self.group, self.label = full.cfg, group, label
        P, r = comm.group_size(group), comm.group_rank(group)
        self.router = full.router
        self.mine = local_experts(full.cfg.experts, P, r)
        self.experts = nn.ModuleDict({str(e): full.experts[str(e)] for e in self.mine})  # global ids kept
        self.aux_loss, self.stats, self.stats_ep = None, {}, {}

    def groups(self, batch: int) -> int:
        return 1  # this rank's tokens are one capacity group (the reference cuts its batch into P of them)

    def run_experts(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Dispatch this rank's kept assignments, run the local experts, combine. x [N, H] -> [N, H]."""
        E, P, group, tag = self.cfg.experts, comm.group_size(self.group), self.group, self.label
        token, choice = routing.keep.nonzero(as_tuple=True)  # kept assignments, token-major
        expert = routing.expert[token, choice]
        order = torch.argsort(expert, stable=True)  # grouped by expert, hence by the rank that owns it
        token, choice, expert = token[order], choice[order], expert[order]

        send_counts = torch.bincount(expert, minlength=E)  # [E]
        recv_counts = exchange_counts(send_counts, group, f"counts {tag}")  # [P, E/P]
        send_splits = send_counts.view(P, -1).sum(dim=1).tolist()  # rows to each rank
        recv_splits = recv_counts.sum(dim=1).tolist()  # rows from each rank
        received = AllToAll.apply(x[token], recv_splits, send_splits, group, f"dispatch {tag}")  # [R, H]

        # The rows arrived by source rank, then by my expert: put them in expert order so each expert runs once.
        # local_id [R]: the local expert of each row that arrived
        local_id = torch.arange(E // P, device=recv_counts.device).repeat(P).repeat_interleave(recv_counts.flatten())
        by_expert = torch.argsort(local_id, stable=True)
        rows_per_expert = recv_counts.sum(dim=0).tolist()  # [E/P]
        with comm.span(f"experts {tag}", "compute"):  # inside the step's forward span
            chunks = received[by_expert].split(rows_per_expert)
            y = torch.cat([self.experts[str(e)](c) for e, c in zip(self.mine, chunks, strict=True)])
            y = y[torch.argsort(by_expert)]  # back in arrival order: [R, H]

        back = AllToAll.apply(y, send_splits, recv_splits, group, f"combine {tag}")  # [S, H], my sorted order
        weighted = routing.gates[token, choice].unsqueeze(-1) * back
        self.stats_ep = {"send_splits": send_splits, "recv_splits": recv_splits, "rows_per_expert": rows_per_expert}
        return torch.zeros_like(x).index_add(0, token, weighted)


def expert_parallel_gpt(model: GPT, group=None) -> GPT:
    """Replace each MoE layer of `model` (in place) by its expert-parallel version on `group`."""
    for i, block in enumerate(model.blocks):
        if isinstance(block.mlp, MoE):
            block.mlp = ExpertParallelMoE(block.mlp, group, label=f"L{i}")
    return model


def sync_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Average the gradients over the W data-holding ranks: dense ones over all ranks (one flat all-reduce),
    expert ones over the dp replicas of each expert (the ep group's tokens are already summed in), then / W."""
    W = comm.group_size()
    dense = [p for n, p in model.named_parameters() if not is_expert_param(n)]
    experts = [p for n, p in model.named_parameters() if is_expert_param(n)]
    for params, group, label in ((dense, None, "dense grads"), (experts, mesh.group("dp"), "expert grads")):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        if group is None or mesh.size("dp") > 1:
            comm.all_reduce(flat, group=group, label=label)  # sum over the group's ranks
        flat /= W
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))


def layer_stats(model: nn.Module) -> list[dict]:
    """Per MoE layer of the last forward: this rank's load per expert, drops, capacity and split sizes."""
    rows = []
    for layer in moe_layers(model):
        tokens = layer.stats["assignments"] // layer.cfg.top_k
        rows.append(
            {
                **layer.stats,
                **getattr(layer, "stats_ep", {}),
                "capacity": capacity(tokens, layer.cfg),
                "aux": layer.aux_loss.item(),
            }
        )
    return rows


def train_expert_parallel(
    model: GPT,
    mesh: DeviceMesh,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    optimizer: str = "sgd",
    lr: float = 0.1,
) -> dict:
    """Rank code: train the MoE GPT with expert parallelism on mesh axis "ep" inside data parallelism ("dp").

    model: the full MoE GPT (the same on every rank); this rank keeps its experts. batches: global [B, T];
    rank r trains on rows [r*B/W, (r+1)*B/W). Returns losses (this rank's, aux included), aux (unweighted sum
    over layers), grads of step 1 and parameters after the last step (those this rank holds), and per step the
    routing stats of each MoE layer.
    """
    W, rank = comm.group_size(), comm.group_rank()
    model = expert_parallel_gpt(model, mesh.group("ep"))
    opt = make_optimizer(model.parameters(), optimizer, lr)
    losses, auxes, stats, first_grads = [], [], [], {}
    for step, (x, y) in enumerate(batches):
        x_r, y_r = shard_batch(x, y, rank, W)  # [B/W, T]
        with comm.span(f"forward {step}", "forward", step=step):
            loss = lm_loss(model(x_r), y_r) + aux_loss(model)  # the forward sets each MoE layer's aux loss
        opt.zero_grad(set_to_none=True)
        with comm.span(f"backward {step}", "backward", step=step):
            loss.backward()
        sync_gradients(model, mesh)
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
        auxes.append(sum(m.aux_loss.item() for m in moe_layers(model)))
        stats.append(layer_stats(model))
        comm.progress(step + 1, len(batches))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "aux": auxes, "grads": first_grads, "params": params, "stats": stats}


# ------------------------------------------------------------------------------------------------------ theory


def all_to_all_payload(
    send_rows: int, recv_rows: int, hidden: int, dtype_bytes: int, experts: int, recomputed: bool = False
) -> int:
    """Bytes one rank hands to all_to_all_single for one MoE layer in one step (forward and backward):
    counts E x 8, dispatch and combine-backward S x H x e each, combine and dispatch-backward R x H x e each.

    recomputed: the block's forward runs a second time in the backward (full activation recomputation reruns the
    whole block, parlab/core/models.py), and with it the layer's three forward all-to-alls (counts, dispatch,
    combine); the backward's two are not repeated."""
    forward = 8 * experts + (send_rows + recv_rows) * hidden * dtype_bytes
    backward = (send_rows + recv_rows) * hidden * dtype_bytes
    return (2 if recomputed else 1) * forward + backward


def balanced_all_to_all_bytes(tokens: int, top_k: int, hidden: int, dtype_bytes: int, world_size: int) -> dict:
    """One direction of one MoE layer for a balanced router without drops: each rank sends tokens x k rows of
    H numbers (payload), of which (P-1)/P leave the rank (wire)."""
    payload = tokens * top_k * hidden * dtype_bytes
    return {"payload": payload, "wire": payload * (world_size - 1) / world_size}
