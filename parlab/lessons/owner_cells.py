"""Lesson 02's drawing helpers: a matrix drawn cell by cell, each cell coloured by the rank that holds it (rank r's
colour; grey: every rank holds the same copy; dark grey: a sum over ranks; white: not held). Used by
parlab/lessons/tensor_parallel.py's GEMM and Megatron-block figures. plotly is imported inside each function.
"""

from __future__ import annotations

import torch

NOT_HELD, SUMMED, REPLICATED = -3, -2, -1  # owner codes of a cell in the figures; r >= 0: held by rank r only
REPLICATED_COLOR, NOT_HELD_COLOR = "#C7C7C7", "#F2F2F2"


def _owner_heatmap(owner: torch.Tensor, values: torch.Tensor | None, P: int, name: str):
    """A heatmap of one matrix, each cell coloured by who holds it: rank r's colour, grey if every rank holds
    the same copy, dark grey if it is a sum over ranks, white if this rank does not hold it."""
    import plotly.graph_objects as go

    from parlab.views.plots import REDUCED_COLOR, rank_color

    colors = [NOT_HELD_COLOR, REDUCED_COLOR, REPLICATED_COLOR] + [rank_color(r) for r in range(P)]
    n = len(colors)
    scale = [[(i + j) / n, c] for i, c in enumerate(colors) for j in (0, 1)]  # discrete: one band per code
    words = {NOT_HELD: "not held", SUMMED: "sum over ranks", REPLICATED: "every rank (replicated)"}
    text = [
        [
            f"{name}[{i}, {j}]<br>{words.get(int(o), f'rank {int(o)}')}"
            + ("" if values is None or int(o) == NOT_HELD else f"<br>{values[i, j].item():.3f}")
            for j, o in enumerate(row)
        ]
        for i, row in enumerate(owner.tolist())
    ]
    return go.Heatmap(
        z=(owner - NOT_HELD).tolist(),
        zmin=-0.5,
        zmax=n - 0.5,
        colorscale=scale,
        showscale=False,
        xgap=1,
        ygap=1,
        text=text,
        hovertemplate="%{text}<extra></extra>",
    )


def _legend_entries(fig, P: int, extra=(("every rank (replicated)", REPLICATED_COLOR),)):
    import plotly.graph_objects as go

    from parlab.views.plots import rank_color

    entries = [(f"rank {r}", rank_color(r)) for r in range(P)] + list(extra)
    for name, color in entries:
        fig.add_trace(
            go.Scatter(
                x=[None], y=[None], mode="markers", name=name, marker={"size": 14, "symbol": "square", "color": color}
            )
        )
