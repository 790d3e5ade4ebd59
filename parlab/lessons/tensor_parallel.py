"""Lesson 02 (notebooks/02_tensor_parallel.ipynb): the demos and figures around the scheme.

The scheme itself, every layer and collective, is in parlab/schemes/tensor_parallel.py; this module only runs it in
small pieces and draws what each rank holds, in the order of the lesson:

    C = A B split two ways     `show_gemm_split`, `gemm_figure`: the GEMM split behind the parallel linears
    a Megatron block           `megatron_figure`: who holds which rows and columns of each weight
    one layer at a time        `check_layers`: each layer against its unsharded counterpart, bytes against theory
    the whole GPT              `comm_figure`: the all-reduce bytes of a `run_tp` report, item by item
    memory                     parameter bytes per rank against P, activations per recompute mode: in
                               parlab/lessons/tensor_parallel_memory.py (re-exported here)

Rank code in this module (`*_rank_fn`) imports torch only; plotly is imported inside each figure function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from parlab.core import comm
from parlab.core.check import check_equal, compare
from parlab.core.models import GPT, GPTConfig, build_model, lm_loss
from parlab.lessons.owner_cells import NOT_HELD, REPLICATED, REPLICATED_COLOR, SUMMED, _legend_entries, _owner_heatmap
from parlab.lessons.tensor_parallel_memory import _check_sizes
from parlab.runtime.errors import Results
from parlab.runtime.launcher import launch
from parlab.schemes.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelMLP,
    TensorParallelSelfAttention,
    VocabParallelEmbedding,
    gather_from_tensor_parallel,
    gather_full,
    reduce_from_tensor_parallel,
    vocab_parallel_cross_entropy,
)

if TYPE_CHECKING:  # figures only; rank code never imports plotly
    import plotly.graph_objects as go


def naive_vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """The naive vocab-parallel loss, for comparison: all-gather the full [B, T, V] logits on every rank, then
    F.cross_entropy. Moves V/P x B x T numbers per rank instead of the 3 x B x T of
    tensor_parallel.vocab_parallel_cross_entropy."""
    full = gather_from_tensor_parallel(logits, "naive loss", group)  # [B, T, V] on every rank
    return lm_loss(full, targets)


# ------------------------------------------------------------------------------------ C = A B, split two ways

SPLITS = ("columns", "rows")


def gemm_inputs(M: int, K: int, N: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A: [M, K], B: [K, N], float64, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(M, K, generator=gen, dtype=torch.float64)  # host: the seeded draw (rank code moves it)
    return A, torch.randn(K, N, generator=gen, dtype=torch.float64)  # host: the seeded draw


def gemm_rank_fn(split: str, M: int, K: int, N: int, seed: int = 0) -> dict:
    """Rank code: C = A B with B split by columns (all-gather C) or by rows (all-reduce the partial C's)."""
    rank, P = dist.get_rank(), dist.get_world_size()
    A, B = (t.to(comm.device()) for t in gemm_inputs(M, K, N, seed))  # drawn on the host, moved to the device
    if split == "columns":  # C = A [B_0 | B_1 | ...] = [A B_0 | A B_1 | ...]
        A_r, B_r = A, B.chunk(P, dim=1)[rank]  # A replicated [M, K]; rank r holds B's columns: [K, N/P]
        C_r = A_r @ B_r  # [M, N/P]: rank r's columns of C, complete
        C = gather_from_tensor_parallel(C_r, "C columns")  # [M, N] on every rank
    else:  # C = [A_0 | A_1 | ...] [B_0; B_1; ...] = sum_r A_r B_r
        A_r, B_r = A.chunk(P, dim=1)[rank], B.chunk(P, dim=0)[rank]  # A's columns [M, K/P], B's rows [K/P, N]
        C_r = A_r @ B_r  # [M, N]: a partial sum, full shape
        C = reduce_from_tensor_parallel(C_r, "C rows")  # [M, N], the sum, on every rank
    return {"A": A_r, "B": B_r, "C_r": C_r, "C": C}


def show_gemm_split(split: str = "columns", world_size: int = 4, M: int = 4, K: int = 8, N: int = 8) -> Results:
    """Run C = A B split by `split` on `world_size` ranks. results[r] = what rank r holds: A, B, C_r, C."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    inner = N if split == "columns" else K
    if inner % world_size:
        raise ValueError(f"{'N' if split == 'columns' else 'K'}={inner} is not divisible by world_size={world_size}")
    return launch(gemm_rank_fn, world_size, split, M, K, N, echo=False)


def gemm_figure(results: Results, split: str) -> go.Figure:
    """What each rank holds of A, B and C in C = A B split by `split`, from a `show_gemm_split` run.

    One row per rank; columns: A, B, the rank's own product C_r, and C after the collective (all-gather for a
    column split, all-reduce for a row split)."""
    from plotly.subplots import make_subplots

    from parlab.views.plots import REDUCED_COLOR, style

    P = len(results)
    M, N = results[0]["C"].shape
    K = results[0]["B"].shape[0] if split == "columns" else sum(r["B"].shape[0] for r in results)
    A_full, B_full = gemm_inputs(M, K, N)
    after = "C after all-gather" if split == "columns" else "C after all-reduce"
    titles = [t for r in range(P) for t in (f"rank {r}: A", "B", "C_r = A_r B_r", after)]
    fig = make_subplots(rows=P, cols=4, subplot_titles=titles, horizontal_spacing=0.04, vertical_spacing=0.06)
    for r, held in enumerate(results):
        own = {k: torch.full(s, NOT_HELD) for k, s in (("A", (M, K)), ("B", (K, N)))}
        if split == "columns":
            own["A"][:] = REPLICATED  # A whole on every rank
            own["B"][:, r * N // P : (r + 1) * N // P] = r
            c_own = torch.full((M, N), NOT_HELD)
            c_own[:, r * N // P : (r + 1) * N // P] = r
            c_local = torch.full((M, N), float("nan"), dtype=torch.float64)
            c_local[:, r * N // P : (r + 1) * N // P] = held["C_r"]
            c_after = torch.arange(N).div(N // P, rounding_mode="floor").expand(M, N)  # column block c from rank c
        else:
            own["A"][:, r * K // P : (r + 1) * K // P] = r
            own["B"][r * K // P : (r + 1) * K // P, :] = r
            c_own, c_local = torch.full((M, N), r), held["C_r"]  # a partial sum, full shape
            c_after = torch.full((M, N), SUMMED)
        panels = [(own["A"], A_full, "A"), (own["B"], B_full, "B"), (c_own, c_local, "C_r"), (c_after, held["C"], "C")]
        for c, (owner, values, name) in enumerate(panels):
            fig.add_trace(_owner_heatmap(owner, values, P, name), row=r + 1, col=c + 1)
    fig.update_yaxes(autorange="reversed", showticklabels=False)
    fig.update_xaxes(showticklabels=False)
    extra = (
        (("sum over ranks", REDUCED_COLOR),) if split == "rows" else (("every rank (replicated)", REPLICATED_COLOR),)
    )
    _legend_entries(fig, P, extra)
    how = (
        "B split by columns: A replicated, C gathered"
        if split == "columns"
        else ("A split by columns, B by rows: partial C's summed")
    )
    return style(fig, f"C = A B on {P} ranks, {how}", height=130 + 170 * P)


# ------------------------------------------------------------------- a Megatron block: who holds what


def held_numbers_rank_fn(kind: str, in_features: int, out_features: int) -> torch.Tensor:
    """Rank code: fill an nn.Linear's W with its element numbers, build this rank's column- or row-parallel slice
    of it, and return the numbers the slice holds."""
    numbered = nn.Linear(in_features, out_features, bias=False).to(comm.device(), torch.float64)
    weight = numbered.weight
    with torch.no_grad():
        weight.copy_(torch.arange(weight.numel(), dtype=torch.float64, device=weight.device).view_as(weight))
    layer_class = ColumnParallelLinear if kind == "column" else RowParallelLinear
    return layer_class(numbered).weight.detach().long().flatten()


def _owners_of(kind: str, in_features: int, out_features: int, P: int) -> torch.Tensor:
    """Owner map of A = W^T [in, out] of a column- or row-parallel linear: which rank holds each element, read
    from the slices the layers on P live ranks hold."""
    owner = torch.full((in_features * out_features,), NOT_HELD)
    for r, held in enumerate(launch(held_numbers_rank_fn, P, kind, in_features, out_features, echo=False)):
        owner[held] = r
    return owner.view(out_features, in_features).T  # A = W^T: [in, out]


def megatron_figure(
    block: str = "mlp", world_size: int = 4, hidden: int = 8, ffn: int = 16, seq: int = 4, heads: int = 4
) -> go.Figure:
    """Who holds what in a Megatron MLP or attention block: X, the first weight (column-parallel), the
    activation between the two GEMMs, the second weight (row-parallel), and Y after g. Weight ownership is
    read from the tensors the ColumnParallelLinear / RowParallelLinear of each rank hold. A = W^T: [in, out]."""
    from plotly.subplots import make_subplots

    from parlab.views.plots import REDUCED_COLOR, style

    P = world_size
    _check_sizes(GPTConfig(vocab_size=P, seq_len=seq, hidden=hidden, heads=heads, layers=1, ffn=ffn), P)
    inner = ffn if block == "mlp" else hidden  # the split dimension: FFN units or heads x hs
    first = _owners_of("column", hidden, inner, P)  # [H, inner], split by columns
    second = _owners_of("row", inner, hidden, P)  # [inner, H], split by rows
    act = first[:1].expand(seq, inner)  # activation [T, inner]: its columns follow the first weight's
    inner_name = "F" if block == "mlp" else "H"
    names = {"mlp": ("A_fc", "GELU(X A_fc)", "A_proj"), "attn": ("A_q, A_k, A_v", "heads", "A_proj")}[block]
    panels = [
        (torch.full((seq, hidden), REPLICATED), "X [T,H]"),
        (first, f"{names[0]} [H,{inner_name}]"),
        (act, f"{names[1]} [T,{inner_name}]"),
        (second, f"{names[2]} [{inner_name},H]"),
        (torch.full((seq, hidden), SUMMED), "Y [T,H]"),
    ]
    widths = [owner.shape[1] for owner, _ in panels]  # panel widths follow the matrices' column counts
    fig = make_subplots(
        rows=1, cols=5, subplot_titles=[t for _, t in panels], horizontal_spacing=0.04, column_widths=widths
    )
    for c, (owner, title) in enumerate(panels):
        fig.add_trace(_owner_heatmap(owner, None, P, title.split(" [")[0]), row=1, col=c + 1)
    fig.update_yaxes(autorange="reversed", showticklabels=False)
    fig.update_xaxes(showticklabels=False)
    _legend_entries(fig, P, (("every rank (replicated)", REPLICATED_COLOR), ("sum over ranks", REDUCED_COLOR)))
    what = (
        "MLP: fc column-parallel, proj row-parallel"
        if block == "mlp"
        else (f"attention: {heads // P} of {heads} heads per rank, proj row-parallel")
    )
    return style(fig, f"Megatron {what} ({P} ranks; A = W^T)", height=360)


# ------------------------------------------------------------------------------------ one layer at a time


def layer_config(dtype: str = "float64") -> GPTConfig:
    """The small model `check_layers` takes its layers from: 8 heads, so world sizes 1, 2, 4 and 8 all work."""
    return GPTConfig(vocab_size=64, seq_len=8, hidden=32, heads=8, layers=1, ffn=128, dtype=dtype)


def layer_inputs(cfg: GPTConfig, batch: int, seed: int, device=None) -> dict[str, torch.Tensor]:
    """The same inputs and upstream gradients on every rank and in the parent (its own generator): drawn on the
    host, then moved to `device` (rank code: parlab.device())."""
    gen = torch.Generator().manual_seed(seed + 1000)
    B, T, H, F_, V = batch, cfg.seq_len, cfg.hidden, cfg.ffn, cfg.vocab_size

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(cfg.torch_dtype)  # host: moved below

    inputs = {
        "x": randn(B, T, H),  # a block's input
        "h": randn(B, T, F_),  # an FFN activation (the row-parallel layer's input)
        "logits": randn(B, T, V),
        "idx": torch.randint(V, (B, T), generator=gen),  # host: moved below
        "targets": torch.randint(V, (B, T), generator=gen),  # host: moved below
        "dy_H": randn(B, T, H),  # upstream gradients: the "loss" of a layer is sum(y * dy)
        "dy_F": randn(B, T, F_),
        "dy_1": torch.ones((), dtype=cfg.torch_dtype),  # host: moved below
    }
    return {name: t.to(device) for name, t in inputs.items()}


# name: (the unsharded layer in build_model(cfg), its input, the input's split dim, upstream grad, output split dim)
LAYERS = {
    "column-parallel linear": ("blocks.0.mlp.fc", "x", None, "dy_F", -1),
    "column-parallel linear, gathered output": ("blocks.0.mlp.fc", "x", None, "dy_F", None),
    "row-parallel linear": ("blocks.0.mlp.proj", "h", -1, "dy_H", None),
    "Megatron MLP": ("blocks.0.mlp", "x", None, "dy_H", None),
    "Megatron attention": ("blocks.0.attn", "x", None, "dy_H", None),
    "vocab-parallel embedding": ("wte", "idx", None, "dy_H", None),
    "vocab-parallel cross-entropy": ("loss", "logits", -1, "dy_1", None),
    "naive cross-entropy (all-gather the logits)": ("loss", "logits", -1, "dy_1", None),
}


def _tp_layer(name: str, full: GPT, targets: torch.Tensor, rank: int, P: int):
    """The tensor-parallel version of LAYERS[name], this rank's slice (over all ranks)."""
    fc, proj = full.blocks[0].mlp.fc, full.blocks[0].mlp.proj
    if name == "column-parallel linear":
        return ColumnParallelLinear(fc, label="column")
    if name == "column-parallel linear, gathered output":
        return ColumnParallelLinear(fc, gather_output=True, label="column gathered")
    if name == "row-parallel linear":
        return RowParallelLinear(proj, label="row")
    if name == "Megatron MLP":
        return TensorParallelMLP(full.blocks[0].mlp, label="mlp")
    if name == "Megatron attention":
        return TensorParallelSelfAttention(full.blocks[0].attn, label="attn")
    if name == "vocab-parallel embedding":
        return VocabParallelEmbedding(full.wte, label="embed")
    V = full.cfg.vocab_size
    if name == "vocab-parallel cross-entropy":
        return lambda logits: vocab_parallel_cross_entropy(logits, targets, rank * V // P)
    return lambda logits: naive_vocab_cross_entropy(logits, targets)


def _mine(t: torch.Tensor, dim: int | None, rank: int, P: int) -> torch.Tensor:
    """This rank's slice of t along dim (a copy of all of t if dim is None)."""
    return (t if dim is None else t.chunk(P, dim=dim)[rank]).clone()


def layers_rank_fn(cfg: GPTConfig, batch: int, seed: int) -> dict:
    """Rank code: run each of LAYERS forward and backward on its slice; return outputs and gradients (slices)."""
    rank, P, dev = comm.group_rank(), comm.group_size(), comm.device()
    full, inputs = build_model(cfg, seed, device=dev), layer_inputs(cfg, batch, seed, device=dev)
    out = {}
    for name, (_, x_key, x_dim, dy_key, y_dim) in LAYERS.items():
        layer = _tp_layer(name, full, inputs["targets"], rank, P)
        x = _mine(inputs[x_key], x_dim, rank, P)
        if x.is_floating_point():
            x.requires_grad_()
        y = layer(x)
        (y * _mine(inputs[dy_key], y_dim, rank, P)).sum().backward()  # this rank's share of sum(y * dy)
        params = dict(layer.named_parameters()) if isinstance(layer, nn.Module) else {}
        out[name] = {
            "y": y.detach(),
            "dx": x.grad,
            "grads": {n: p.grad for n, p in params.items()},
            "dims": {"y": y_dim, "dx": x_dim, **{n: p.tp_split_dim for n, p in params.items()}},
        }
    return out


def _reference_layer(name: str, full: GPT, targets: torch.Tensor):
    path = LAYERS[name][0]
    if path == "loss":
        return lambda logits: lm_loss(logits, targets)
    return full.get_submodule(path)


def layer_comm_theory(cfg: GPTConfig, batch: int, world_size: int) -> dict[str, dict[str, int]]:
    """Payload bytes per rank of each layer's collectives, by label."""
    e, BT = cfg.dtype_bytes, batch * cfg.seq_len
    BTH, BTF, BTV = BT * cfg.hidden * e, BT * cfg.ffn * e, BT * cfg.vocab_size * e
    return {
        "column-parallel linear": {"f bwd column": BTH},
        "column-parallel linear, gathered output": {
            "f bwd column gathered": BTH,
            "gather fwd column gathered": BTF // world_size,  # all-gather: each rank's own contribution
        },
        "row-parallel linear": {"g fwd row": BTH},
        "Megatron MLP": {"g fwd mlp": BTH, "f bwd mlp": BTH},
        "Megatron attention": {"g fwd attn": BTH, "f bwd attn": BTH},
        "vocab-parallel embedding": {"g fwd embed": BTH},
        "vocab-parallel cross-entropy": {"loss max": BT * e, "loss sum-exp": BT * e, "loss target logit": BT * e},
        "naive cross-entropy (all-gather the logits)": {"gather fwd naive loss": BTV // world_size},
    }


def check_layers(world_size: int = 4, dtype: str = "float64", seed: int = 0, batch: int = 2) -> dict:
    """Each tensor-parallel layer against its unsharded counterpart: outputs, input gradients and weight
    gradients (gathered to full shape), and each layer's communication against theory.

    Returns {"verdicts": [Verdict per layer], "comm": [CountCheck per layer and label], "results": Results}.
    """
    cfg = layer_config(dtype)
    _check_sizes(cfg, world_size)
    results = launch(layers_rank_fn, world_size, cfg, batch, seed, echo=False)
    full, inputs = build_model(cfg, seed), layer_inputs(cfg, batch, seed)  # host: the parent's reference
    verdicts = []
    for name, (_, x_key, _, dy_key, _) in LAYERS.items():
        layer = _reference_layer(name, full, inputs["targets"])
        x = inputs[x_key].clone()
        if x.is_floating_point():
            x.requires_grad_()
        if isinstance(layer, nn.Module):
            layer.zero_grad()
        y = layer(x)
        (y * inputs[dy_key]).sum().backward()
        mine = [r[name] for r in results]
        flat = [{"y": m["y"], "dx": m["dx"], **m["grads"]} for m in mine]
        dims = {k: v for k, v in mine[0]["dims"].items() if k != "dx" or x.requires_grad}
        ours = gather_full(flat, dims)
        params = dict(layer.named_parameters()) if isinstance(layer, nn.Module) else {}
        ref = {"y": y.detach(), **({"dx": x.grad} if x.requires_grad else {}), **{n: p.grad for n, p in params.items()}}
        verdicts.append(compare(f"{name}: output and every gradient", ours, ref))
    measured = itemise_labels(results.trace)
    checks = [
        check_equal(f"{name}: {label} payload bytes", measured.get(label, [0])[0], value)
        for name, labels in layer_comm_theory(cfg, batch, world_size).items()
        for label, value in labels.items()
    ]
    return {"verdicts": verdicts, "comm": checks, "results": results}


def itemise_labels(trace) -> dict[str, list[int]]:
    """Payload bytes per rank of every collective, by its exact label."""
    items: dict[str, list[int]] = {}
    for e in trace.events:
        if not e.is_compute:
            items.setdefault(e.label, [0] * trace.world_size)[e.rank] += e.bytes
    return items


# ----------------------------------------------------------------- the whole GPT: all-reduce bytes by item


def comm_figure(report: dict) -> go.Figure:
    """All-reduce payload bytes per training step by item (lesson 00: what each rank hands to the all-reduce; a
    ring sends 2(P-1)/P of it), measured on rank 0 beside the theory, from a tp report."""
    import plotly.graph_objects as go

    from parlab.views.plots import kind_color, style

    items = report["comm"]["items_per_step"]
    names = list(items)
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            name="measured (rank 0)",
            x=names,
            y=[items[k]["measured"][0] for k in names],
            marker_color=kind_color("all_reduce"),
            hovertemplate="%{x}: %{y} payload bytes<extra></extra>",
        )
    )
    fig.add_trace(
        go.Bar(
            name="theory",
            x=names,
            y=[items[k]["theory"] for k in names],
            marker_color="#BAB0AC",
            hovertemplate="%{x}: %{y} payload bytes<extra></extra>",
        )
    )
    fig.update_layout(barmode="group")
    title = (
        f"All-reduce payload per step: L={report['layers']}, B={report['batch']}, T={report['seq']}, "
        f"H={report['hidden']}, {report['world_size']} ranks"
    )
    return style(fig, title, "what the all-reduce is for", "payload bytes per rank per step", height=460)
