"""Lesson 05 (notebooks/05_zero.ipynb): the figures and measurements around ZeRO.

The scheme (flat shards, Adam by hand, the stage 2/3 hooks, the training loop, the formulas) is in
parlab/schemes/zero/stages.py, and `parlab.runs.zero.run_zero` runs and checks it; this module measures and draws:

    DP's redundancy, measured    `run_dp_memory`: what each rank of plain DP holds (same recipe as ZeRO)
    memory per rank per stage    `draw_memory` (`stage_bars`): stacked bars, measured, the paper's formula marked
    one step on a timeline       `draw_step`: forward, backward, reduce-scatters, Adam, all-gathers (prefetch)
    the calculator               `draw_calculator`: the paper's formulas for any Psi, N, K
"""

from __future__ import annotations

import torch

from parlab.core import comm
from parlab.core.memory import tensor_bytes
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches
from parlab.core.trace import Trace
from parlab.runtime.launcher import launch
from parlab.schemes.data_parallel import all_reduce_gradients, shard_batch
from parlab.schemes.zero.theory import zero_memory

COMPONENTS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states (master, m, v)"}
TRANSIENT = {"gathered params": "gathered parameters (peak)", "grad buckets": "gradient buckets in flight (peak)"}
COMPONENT_COLORS = {
    "params": "#4C78A8",
    "grads": "#F58518",
    "optimizer": "#B279A2",
    "gathered params": "#9ECAE9",
    "grad buckets": "#FFBF79",
}


# ------------------------------------------------------------------------------------ DP's memory, measured


def _dp_mixed_precision_rank(cfg: GPTConfig, batch: int, lr: float) -> dict:
    """Rank code: one step of plain DP with ZeRO's mixed-precision recipe (bf16 compute copy and gradients,
    fp32 master weights and Adam states, all-reduce in bf16); returns what this rank holds, and its Adam m."""
    P, rank, dev = comm.group_size(), comm.group_rank(), comm.device()
    model = build_model(cfg, 0, device=dev)  # fp32, on this rank's device
    master = [p.detach().clone() for p in model.parameters()]  # fp32 master weights [Psi]
    opt = torch.optim.Adam(master, lr=lr)
    model.to(torch.bfloat16)  # the compute copy
    x, y = shard_batch(*make_batches(cfg, batch, 1, 0, device=dev)[0], rank, P)
    lm_loss(model(x), y).backward()
    all_reduce_gradients(model)  # every rank: the same bf16 gradients [Psi]
    for w, p in zip(master, model.parameters(), strict=True):
        w.grad = p.grad.float()
    opt.step()
    states = [{k: v for k, v in s.items() if k != "step"} for s in opt.state.values()]  # m, v (not the counter)
    held = {
        "params": tensor_bytes(list(model.parameters())),
        "grads": tensor_bytes([p.grad for p in model.parameters()]),
        "optimizer": tensor_bytes(master, states),
    }
    return {"held": held, "m": torch.cat([s["exp_avg"].reshape(-1) for s in states])}


def run_dp_memory(world_size: int, cfg: GPTConfig | None = None, batch: int = 8, lr: float = 1e-3) -> list[dict]:
    """What every rank of plain DP holds with the mixed-precision recipe (measured), and its Adam m."""
    return list(launch(_dp_mixed_precision_rank, world_size, cfg or GPTConfig(dtype="float32"), batch, lr, echo=False))


# ----------------------------------------------------------------------------------------------- figures


def draw_memory(bars: dict[str, list[dict]], formulas: dict[str, float] | None = None, title: str = ""):
    """Stacked bars, one per rank per run: params, grads, optimizer states held (measured), and on top the
    transient peaks (gathered parameters, gradient buckets) in lighter colours. bars: {run name: [per rank:
    {"params": bytes, ...}]}; formulas: {run name: the paper's total}, drawn as a black marker."""
    import plotly.graph_objects as go

    from parlab.views import plots

    x = [
        [name for name, ranks in bars.items() for _ in ranks],
        [f"r{r}" for ranks in bars.values() for r in range(len(ranks))],
    ]
    fig = go.Figure()
    for key, label in {**COMPONENTS, **TRANSIENT}.items():
        values = [held.get(key, 0) / 1e3 for ranks in bars.values() for held in ranks]
        if not any(values):
            continue
        fig.add_trace(
            go.Bar(
                x=x,
                y=values,
                name=label,
                marker={"color": COMPONENT_COLORS[key], "pattern": {"shape": "/" if key in TRANSIENT else ""}},
                hovertemplate=f"{label}<br>%{{x}}<br>%{{y:.2f}} KB<extra></extra>",
            )
        )
    if formulas:
        fx = [
            [name for name, ranks in bars.items() for _ in ranks],
            [f"r{r}" for ranks in bars.values() for r in range(len(ranks))],
        ]
        fy = [formulas[name] / 1e3 for name, ranks in bars.items() for _ in ranks]
        fig.add_trace(
            go.Scatter(
                x=fx,
                y=fy,
                mode="markers",
                name="the paper's formula (steady)",
                marker={"symbol": "line-ew-open", "size": 28, "color": "black", "line": {"width": 3}},
                hovertemplate="formula %{y:.2f} KB<extra></extra>",
            )
        )
    fig.update_layout(barmode="stack")
    return plots.style(fig, title or "Memory held per rank (measured)", "run / rank", "KB held by the rank", 480)


def stage_bars(results) -> list[dict]:
    """Per rank of a ZeRO run: what it held before the optimizer step, with its transient peaks (draw_memory)."""
    return [{**r["steady"], **{k: r["peak"][k] for k in TRANSIENT}} for r in results]


def one_step(trace: Trace, step: int) -> Trace:
    """The events of one step on each rank: from its first compute span tagged `step` to the first span of the
    next step (so the all-gathers after the optimizer step are included)."""
    events = []
    for rank in range(trace.world_size):
        mine = trace.select(rank=rank)
        starts = {}
        for e in mine:
            if e.is_compute and "step" in e.extra:
                starts.setdefault(e.extra["step"], e.start)
        start, end = starts[step], starts.get(step + 1, float("inf"))
        events += [e for e in mine if start <= e.start < end and not e.label.startswith("check")]
    return Trace(events, trace.world_size)


def draw_step(trace: Trace, step: int, title: str):
    """Timeline of one ZeRO step, every rank: compute above, reduce-scatters and all-gathers below (the labels
    name the layer; "prefetch" marks an all-gather started one layer early). Times measured in the ranks."""
    from parlab.views import plots

    return plots.timeline(one_step(trace, step), title)


def draw_calculator(psi: float, N: int, K: float = 12):
    """The paper's per-device memory for DP and stages 1-3 (mixed precision: 2 + 2 + K bytes per parameter)."""
    import plotly.graph_objects as go

    from parlab.views import plots

    table = zero_memory(psi, N, K)
    names = ["DP", "stage 1 (P_os)", "stage 2 (P_os+g)", "stage 3 (P_os+g+p)"]
    fig = go.Figure()
    for key, label in COMPONENTS.items():
        fig.add_trace(
            go.Bar(
                x=names,
                y=[table[s][key] / 1e9 for s in range(4)],
                name=label,
                marker={"color": COMPONENT_COLORS[key]},
                hovertemplate=f"{label}<br>%{{x}}: %{{y:.2f}} GB<extra></extra>",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=names,
            y=[table[s]["total"] / 1e9 for s in range(4)],
            mode="text",
            text=[f"{table[s]['total'] / 1e9:.1f} GB" for s in range(4)],
            textposition="top center",
            showlegend=False,
        )
    )
    fig.update_layout(barmode="stack")
    title = f"Memory per device: Psi = {psi / 1e9:g}B parameters, N = {N}, K = {K:g}"
    return plots.style(fig, title, None, "GB per device", 450)


def calculator_lines(psi: float, N: int, K: float = 12) -> list[str]:
    """The calculator as text: per-device GB of each stage, and the formula it comes from."""
    table = zero_memory(psi, N, K)
    forms = ["(2+2+K) Psi", "2 Psi + 2 Psi + K Psi/N", "2 Psi + (2+K) Psi/N", "(2+2+K) Psi/N"]
    names = ["DP     ", "stage 1", "stage 2", "stage 3"]
    return [f"{names[s]}  {forms[s]:<24} = {table[s]['total'] / 1e9:7.1f} GB" for s in range(4)]
