"""Lesson 02 (notebooks/02_tensor_parallel.ipynb), its memory sections: what each rank holds.

    parameter memory       `measure_param_bytes`, `param_memory_figure`: parameter bytes each rank holds against P
    activation memory      `recompute_table`, `recompute_figure`: the activations autograd keeps per layer with
                           recompute = none, selective, full (parlab/schemes/recompute/measure.py), measured beside the
                           formulas, and the time and FLOPs the recomputation costs

Rank code in this module (`*_rank_fn`) imports torch only; plotly is imported inside each figure function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parlab.core import comm
from parlab.core.memory import tensor_bytes
from parlab.core.models import RECOMPUTE, GPTConfig, build_model
from parlab.runs.tensor_parallel import TPOptions
from parlab.runtime.launcher import launch
from parlab.schemes.recompute.measure import measure_layer, measure_model, recompute_flops_theory, time_step
from parlab.schemes.recompute.theory import formula_bytes, korthikanti_bytes
from parlab.schemes.tensor_parallel import TensorParallelGPT, param_bytes_theory

if TYPE_CHECKING:  # figures only; rank code never imports plotly
    import plotly.graph_objects as go


def _check_sizes(cfg: GPTConfig, world_size: int) -> None:
    """The scheme's own checks (TPOptions.validate) of a model config, before any process starts."""
    TPOptions.for_config(cfg, world_size=world_size, steps=1, batch=1).validate()


def param_bytes_rank_fn(cfg: GPTConfig) -> int:
    """Rank code: build this rank's slice of the model and count the bytes of the tensors it holds."""
    return tensor_bytes(TensorParallelGPT(build_model(cfg, device=comm.device())).parameters())


def measure_param_bytes(cfg: GPTConfig, world_sizes=(1, 2, 4, 8)) -> dict[int, list[int]]:
    """{P: [parameter bytes held by rank 0 .. P-1]}, measured on live ranks for each world size."""
    for P in world_sizes:  # every size is checked before any process starts
        _check_sizes(cfg, P)
    return {P: list(launch(param_bytes_rank_fn, P, cfg, echo=False)) for P in world_sizes}


def param_memory_figure(measured: dict[int, list[int]], cfg: GPTConfig) -> go.Figure:
    """Parameter bytes per rank against world size: measured on each rank, the ideal total/P, and the theory
    (replicated LayerNorms, biases and position embedding stay whole)."""
    import plotly.graph_objects as go

    from parlab.views.plots import rank_color, style

    total = tensor_bytes(build_model(cfg).parameters())
    Ps = sorted(measured)
    fig = go.Figure()
    for P in Ps:
        fig.add_trace(
            go.Scatter(
                x=[P * 1.03 ** (r - (P - 1) / 2) for r in range(P)],  # side by side (they hold the same)
                y=measured[P],
                mode="markers",
                name="measured, one marker per rank",
                showlegend=P == Ps[-1],
                marker={"size": 12, "color": [rank_color(r) for r in range(P)]},
                text=[f"rank {r}" for r in range(P)],
                hovertemplate="%{text}: %{y} bytes<extra></extra>",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=Ps, y=[param_bytes_theory(cfg, P) for P in Ps], mode="lines", name="theory", line={"color": "#333333"}
        )
    )
    fig.add_trace(
        go.Scatter(
            x=Ps,
            y=[total / P for P in Ps],
            mode="lines",
            name="single device / P",
            line={"dash": "dash", "color": "#888888"},
        )
    )
    fig.update_xaxes(type="log", tickvals=Ps, ticktext=[str(P) for P in Ps])
    fig.update_yaxes(type="log")
    return style(
        fig,
        "Parameter bytes each rank holds (markers: measured, one per rank)",
        "world size P",
        "bytes per rank",
        height=440,
    )


# ------------------------------------------------------------------ activation memory: recomputation


def recompute_config() -> GPTConfig:
    """The lesson's model: T = 64 so that the T x T scores matter; 2 layers, float64."""
    return GPTConfig(vocab_size=64, seq_len=64, hidden=32, heads=4, layers=2)


def recompute_table(cfg: GPTConfig | None = None, batch: int = 2) -> list[dict]:
    """Per recompute mode: saved activation bytes per layer, measured (one block, parlab.core.memory) beside the formula
    adapted to this GPT and Korthikanti et al.'s as published (fp16, dropout); the whole model's saved bytes;
    the matmul FLOPs of the forward and those recomputed in the backward (measured, and the theory); whether the
    loss and every gradient equal recompute="none"'s bit for bit."""
    cfg = cfg or recompute_config()
    runs = {mode: measure_model(cfg, batch, mode) for mode in RECOMPUTE}
    rows = []
    for mode, run in runs.items():
        same = torch.equal(run["loss"], runs["none"]["loss"]) and all(
            torch.equal(g, runs["none"]["grads"][n]) for n, g in run["grads"].items()
        )
        rows.append(
            {
                "mode": mode,
                "measured": measure_layer(cfg, batch, mode),
                "formula": formula_bytes(cfg, batch, mode),
                "korthikanti_fp16": korthikanti_bytes(cfg, batch, mode),
                "model_saved": run["saved"],
                "forward_flops": run["forward_flops"],
                "recomputed_flops": run["backward_flops"] - runs["none"]["backward_flops"],
                "recomputed_flops_theory": cfg.layers * recompute_flops_theory(cfg, batch, mode),
                "bit_for_bit": same,
            }
        )
    return rows


def recompute_times(cfg: GPTConfig | None = None, batch: int = 2, repeats: int = 7) -> dict[str, float]:
    """Median seconds of one forward + backward per mode, on this machine (timings vary: not a check)."""
    cfg = cfg or recompute_config()
    return {mode: time_step(cfg, batch, mode, repeats) for mode in RECOMPUTE}


def parallel_forms_rank_fn(cfg: GPTConfig, batch: int) -> dict[str, int]:
    """Rank code: bytes one transformer block keeps on this rank under tensor parallelism and under Megatron SP."""
    import torch.distributed as dist

    from parlab.core.memory import saved_activations
    from parlab.schemes.sequence.sequence_parallel import MegatronSPGPT

    out, P, dev = {}, dist.get_world_size(), comm.device()
    for form, make, T in (("tp", TensorParallelGPT, cfg.seq_len), ("tp+sp", MegatronSPGPT, cfg.seq_len // P)):
        block = make(build_model(cfg, device=dev)).blocks[0]
        x = torch.randn(batch, T, cfg.hidden, dtype=cfg.torch_dtype, device=dev, requires_grad=True)  # rank's input
        with saved_activations(exclude=block) as saved:
            block(x)
        out[form] = saved.bytes
    return out


def measure_parallel_forms(cfg: GPTConfig | None = None, batch: int = 2, world_size: int = 4) -> dict[str, dict]:
    """Saved bytes per layer on rank 0 with TP and with TP + Megatron SP (no recomputation), beside the formulas."""
    cfg = cfg or recompute_config()
    _check_sizes(cfg, world_size)
    measured = launch(parallel_forms_rank_fn, world_size, cfg, batch, echo=False)[0]
    return {
        form: {
            "measured": measured[form],
            "formula": formula_bytes(cfg, batch, "none", form, world_size),
            "korthikanti_fp16": korthikanti_bytes(cfg, batch, "none", form, world_size),
        }
        for form in ("tp", "tp+sp")
    }


def recompute_figure(rows: list[dict], times: dict[str, float] | None = None) -> go.Figure:
    """Left: activation bytes kept per layer per mode, measured (bars) and the adapted formula (markers).
    Right: what it costs: FLOPs recomputed in the backward, as a share of the forward (measured), and, when
    given, the time of a training step."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from parlab.views.plots import style

    modes = [r["mode"] for r in rows]
    right = "time of one forward + backward (ms)" if times else "recomputed FLOPs (% of the forward)"
    fig = make_subplots(rows=1, cols=2, subplot_titles=("activations kept per layer (bytes)", right))
    fig.add_trace(
        go.Bar(x=modes, y=[r["measured"] for r in rows], name="measured (saved by autograd)", marker_color="#7B3294"),
        row=1,
        col=1,
    )
    marker = {"symbol": "line-ew-open", "size": 40, "line": {"width": 3}, "color": "black"}
    fig.add_trace(
        go.Scatter(
            x=modes,
            y=[r["formula"] for r in rows],
            mode="markers",
            marker=marker,
            name="formula (Korthikanti, adapted)",
        ),
        row=1,
        col=1,
    )
    extra = [100 * r["recomputed_flops"] / r["forward_flops"] for r in rows]
    labels = [f"+{e:.0f}% FLOPs" for e in extra]
    y = [1000 * times[m] for m in modes] if times else extra
    fig.add_trace(
        go.Bar(
            x=modes,
            y=y,
            text=labels,
            name="cost",
            marker_color="#E69F00",
            showlegend=False,
            textposition="outside",
            textangle=0,
        ),
        row=1,
        col=2,
    )
    return style(fig, "Activation recomputation: memory kept against compute paid", None, None, height=430)
