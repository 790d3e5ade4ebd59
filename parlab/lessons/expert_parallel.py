"""Lesson 09 (notebooks/09_expert_parallel.ipynb): the demos and figures around Mixture-of-Experts and expert
parallelism.

The MoE layer is parlab/core/moe.py, expert parallelism parlab/schemes/expert_parallel.py (run and checked by
parlab/runs/expert_parallel.py). This module runs them in small pieces and draws them:

    why MoE             `size_rows`, `size_figure`: parameters per layer grow with E, those a token uses with k
    routing             `routing_demo`, `routing_figure`: token by token, the router's probabilities, the k chosen
                        experts, the slot each assignment took in its expert's queue, the dropped ones
    the shuffle         `split_matrix`, `shuffle_figure`: rows each rank sent to each rank in one all-to-all
                        (measured: the split sizes each rank handed to all_to_all_single)
    balance             `load_per_step`, `balance_figure`: load imbalance and aux loss over a few steps
    capacity            `capacity_rows`, `capacity_figure`: dropped assignments, empty slots, traffic vs the factor
    the mesh            `mesh_rows`, `axis_bytes`: EP inside DP, which rank holds which experts, bytes per axis

plotly is imported inside each figure function.
"""

from __future__ import annotations

import torch

from parlab.core.mesh import mesh_coords
from parlab.core.models import GPTConfig, build_model, make_batches
from parlab.core.moe import MoEConfig, Routing, capacity, moe_param_counts, route
from parlab.runtime.errors import Results
from parlab.schemes.expert_parallel import local_experts

# ------------------------------------------------------------------------------------------------- why MoE


def size_rows(hidden: int = 4096, ffn: int = 14336, top_k: int = 2, experts=(1, 2, 4, 8, 16, 32, 64)) -> list[dict]:
    """Per FFN layer: parameters held and parameters (hence FLOPs, 2 per multiply-add) a token uses, per E."""
    rows = []
    for E in experts:
        k = min(top_k, E)
        counts = moe_param_counts(hidden, ffn, MoEConfig(experts=E, top_k=k))
        rows.append(
            {"experts": E, "params": counts["total"], "active": counts["active"], "flops": 2 * counts["active"]}
        )
    return rows


def size_figure(rows: list[dict]):
    """Parameters held vs parameters a token uses, against the number of experts (log scale)."""
    import plotly.graph_objects as go

    from parlab.views.plots import style

    E = [r["experts"] for r in rows]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=E,
            y=[r["params"] / 1e6 for r in rows],
            name="parameters held",
            mode="lines+markers",
            hovertemplate="E=%{x}: %{y:.0f} M parameters<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=E,
            y=[r["active"] / 1e6 for r in rows],
            name="parameters a token uses (FLOPs)",
            mode="lines+markers",
            hovertemplate="E=%{x}: %{y:.0f} M per token<extra></extra>",
        )
    )
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return style(
        fig,
        "One FFN layer (Mixtral's sizes, top-2): parameters grow with E, FLOPs per token do not",
        "experts E",
        "millions of parameters",
        height=420,
    )


# ------------------------------------------------------------------------------------------------- routing


def routing_demo(tokens: int = 12, experts: int = 4, top_k: int = 2, capacity_factor: float = 1.0, seed: int = 0):
    """Route `tokens` random tokens (H = 8) with a random router: returns (probs [N, E], Routing, capacity)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = MoEConfig(experts=experts, top_k=top_k, capacity_factor=capacity_factor)
    x = torch.randn(tokens, 8, generator=gen, dtype=torch.float64)
    router = torch.nn.Linear(8, experts, bias=False).double()
    with torch.no_grad():
        router.weight.copy_(0.3 * torch.randn(experts, 8, generator=gen, dtype=torch.float64))  # unsaturated
        return router(x).softmax(-1), route(x, router, cfg), capacity(tokens, cfg)


def slots(routing: Routing) -> torch.Tensor:
    """[N, k]: the place of each assignment in its expert's queue (first choices first, earlier tokens first)."""
    queue = routing.expert.T.reshape(-1)
    onehot = torch.nn.functional.one_hot(queue, int(routing.load.numel()))
    return ((onehot.cumsum(0) - 1) * onehot).sum(-1).reshape(routing.expert.shape[1], -1).T


def routing_figure(probs: torch.Tensor, routing: Routing, cap: int):
    """Tokens as rows, experts as columns, the router's probability as colour; each chosen expert marked with
    its choice (1st, 2nd) and its slot; a dropped assignment (slot >= capacity) crossed out."""
    import plotly.graph_objects as go

    from parlab.views.plots import style

    N, E = probs.shape
    place = slots(routing)
    fig = go.Figure(
        go.Heatmap(
            z=probs.tolist(),
            x=[f"expert {e}" for e in range(E)],
            y=[f"token {i}" for i in range(N)],
            colorscale="Blues",
            zmin=0,
            zmax=1,
            colorbar={"title": "p"},
            hovertemplate="%{y}, %{x}: p = %{z:.2f}<extra></extra>",
        )
    )
    for i in range(N):
        for j in range(routing.expert.shape[1]):
            kept = bool(routing.keep[i, j])
            text = f"#{j + 1} slot {int(place[i, j])}" + ("" if kept else " DROPPED")
            fig.add_annotation(
                x=f"expert {int(routing.expert[i, j])}",
                y=f"token {i}",
                text=text,
                showarrow=False,
                font={"color": "black" if kept else "#D55E00", "size": 13},
            )
    fig.update_yaxes(autorange="reversed")
    title = f"Routing {N} tokens to {E} experts, top-{routing.expert.shape[1]}, capacity {cap} slots per expert"
    return style(fig, title, height=140 + 34 * N)


# ------------------------------------------------------------------------------------------------- the shuffle


def split_matrix(results: Results, step: int = 0, layer: int = 0) -> list[list[int]]:
    """[P][P]: rows rank s handed to rank d in the dispatch all-to-all (its send split sizes, measured)."""
    return [r["stats"][step][layer]["send_splits"] for r in results]


def shuffle_figure(matrix: list[list[int]], experts: int):
    """The dispatch all-to-all as a shuffle: rows sent from each rank (row) to each rank (column)."""
    import plotly.graph_objects as go

    from parlab.views.plots import style

    P = len(matrix)
    per = experts // P
    dest = [f"to rank {d}<br>(experts {d * per}-{d * per + per - 1})" for d in range(P)]
    fig = go.Figure(
        go.Heatmap(
            z=matrix,
            x=dest,
            y=[f"from rank {s}" for s in range(P)],
            colorscale="Greens",
            text=matrix,
            texttemplate="%{text}",
            textfont={"size": 18},
            hovertemplate="%{y} %{x}: %{z} token rows<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    return style(
        fig, "Dispatch: token rows each rank sends to each rank (the split sizes it handed over)", height=160 + 70 * P
    )


# ------------------------------------------------------------------------------------------------- balance


def load_per_step(results: Results, experts: int) -> list[list[int]]:
    """[steps][E]: assignments routed to each expert (all ranks, all MoE layers), per step, before drops."""
    steps = len(results[0]["stats"])
    return [
        [sum(layer["load"][e] for r in results for layer in r["stats"][k]) for e in range(experts)]
        for k in range(steps)
    ]


def imbalance(load: list[int]) -> float:
    """max / mean load: 1.0 is perfectly balanced; the busiest expert sets the pace (and drops first)."""
    return max(load) / (sum(load) / len(load))


def balance_figure(runs: dict[str, tuple[Results, dict]]):
    """Per run (label -> (results, report)): load imbalance and aux loss at each step."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from parlab.views.plots import style

    fig = make_subplots(rows=1, cols=2, subplot_titles=["load imbalance (max / mean)", "aux loss (sum over layers)"])
    for i, (label, (results, report)) in enumerate(runs.items()):
        loads = load_per_step(results, report["experts"])
        steps = list(range(1, len(loads) + 1))
        color = ["#0072B2", "#D55E00", "#009E73"][i % 3]
        fig.add_trace(
            go.Scatter(
                x=steps, y=[imbalance(x) for x in loads], name=label, mode="lines+markers", line={"color": color}
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=steps, y=report["aux_loss"], name=label, mode="lines+markers", showlegend=False, line={"color": color}
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(title_text="step")
    return style(fig, "Load balance over training, with and without the auxiliary loss", height=420)


# ------------------------------------------------------------------------------------------------- capacity


def first_layer_routing(cfg: GPTConfig, batch: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.nn.Linear]:
    """The tokens entering the first MoE layer of the (untrained) GPT on one batch, and that layer's router."""
    model = build_model(cfg, seed)
    x, _ = make_batches(cfg, batch, 1, seed)[0]
    block = next(b for b in model.blocks if hasattr(b.mlp, "router"))
    with torch.no_grad():
        h = model.embed(x)
        for b in model.blocks:
            if b is block:
                break
            h = b(h)
        h = h + block.attn(block.ln1(h))
        return block.ln2(h).reshape(-1, cfg.hidden), block.mlp.router


def capacity_rows(x: torch.Tensor, router, experts: int, top_k: int, factors) -> list[dict]:
    """For each capacity factor: capacity, dropped assignments, empty slots (padding), and the rows a padded
    dispatch sends (E x C: what fixed-shape systems such as GShard send) against the rows really kept."""
    rows = []
    for f in factors:
        cfg = MoEConfig(experts=experts, top_k=top_k, capacity_factor=f)
        with torch.no_grad():
            routing = route(x, router, cfg)
        C, kept = capacity(x.shape[0], cfg), int(routing.keep.sum())
        rows.append(
            {
                "factor": f,
                "capacity": C,
                "dropped": int((~routing.keep).sum()),
                "kept": kept,
                "padding": experts * C - kept,
                "padded_rows": experts * C,
                "load": routing.load.tolist(),
            }
        )
    return rows


def capacity_figure(row: dict):
    """One capacity factor: each expert's load as a bar, the capacity as a line; what lies above it is dropped."""
    import plotly.graph_objects as go

    from parlab.views.plots import style

    E, C = len(row["load"]), row["capacity"]
    names = [f"expert {e}" for e in range(E)]
    kept = [min(n, C) for n in row["load"]]
    fig = go.Figure(
        [
            go.Bar(x=names, y=kept, name="kept", marker_color="#0072B2"),
            go.Bar(
                x=names,
                y=[n - k for n, k in zip(row["load"], kept, strict=True)],
                name="dropped",
                marker_color="#D55E00",
            ),
        ]
    )
    fig.add_hline(y=C, line_dash="dash", annotation_text=f"capacity {C}")
    fig.update_layout(barmode="stack")
    title = (
        f"capacity factor {row['factor']}: {row['dropped']} of {row['dropped'] + row['kept']} assignments "
        f"dropped, {row['padding']} empty slots"
    )
    return style(fig, title, None, "assignments (token x choice)", height=400)


# ------------------------------------------------------------------------------------------------- the mesh


def mesh_rows(report: dict) -> list[str]:
    """One line per rank of a DP x EP run: its place on the mesh, the experts it holds, its bytes per axis."""
    axes, E = report["mesh"]["axes"], report["experts"]
    lines = []
    for r in range(report["world_size"]):
        c = mesh_coords(r, axes)
        mine = local_experts(E, axes["ep"], c["ep"])
        lines.append(f"rank {r}: dp {c['dp']}, ep {c['ep']}: experts {mine.start}-{mine.stop - 1} + the dense weights")
    return lines


def axis_bytes(results: Results) -> dict[str, dict[str, list[int]]]:
    """Payload bytes per rank, per mesh axis ("dp", "ep", and None for the world group) and kind of call."""
    return {str(axis): results.trace.bytes_per_rank(axis=axis) for axis in ("ep", "dp")}
