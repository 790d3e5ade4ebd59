"""Lesson 04 (notebooks/04_sequence_parallel.ipynb): the demos and figures around sequence parallelism.

The methods themselves are in parlab/schemes/sequence/sequence_parallel.py (Megatron SP, the GPTs, the theory),
parlab/schemes/sequence/ring_attention.py and parlab/schemes/sequence/ulysses.py; this module runs them in small pieces
and draws them:

    ring attention, stepped    `ring_demo`, `ring_steps`, `draw_ring_step`: which K/V block each rank holds at
                               each step and which tiles of the T x T score matrix are done, from the trace
    Ulysses' all-to-all        `ulysses_demo`, `draw_ulysses`: the (sequence block, head group) pieces each rank
                               holds before and after, a transpose
    bytes vs theory            `comm_rows`, `comm_figure`: per method, measured bytes per rank per step: the
                               payload handed to each collective, or what is sent (lesson 00's two counts)
    memory vs sequence length  `measure_activations`, `memory_figure`: saved activations per rank (parlab.core.memory)
    USP (schemes/sequence/usp.py) `usp_demo`, `draw_usp`: who holds which (head, token) between and inside attention
                               on a ulysses x ring mesh; `usp_comm_rows`, `usp_comm_figure`: bytes per mesh axis

Rank code in this module (`*_rank_fn`) imports torch only; plotly is imported inside each figure function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab.core import comm
from parlab.core.check import Verdict, compare
from parlab.core.memory import saved_activations
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches
from parlab.runs.sequence_parallel import SPOptions
from parlab.runtime.errors import Results
from parlab.runtime.launcher import launch
from parlab.schemes.sequence.ring_attention import chunks_of, ring_attention, sequence_split, tile_mask, zigzag_merge
from parlab.schemes.sequence.sequence_parallel import MegatronSPGPT, SequenceShardedGPT, shard_batch
from parlab.schemes.sequence.ulysses import check_heads, seq_to_heads, ulysses_attention
from parlab.views.plots import rank_color, square_legend, style

# ---------------------------------------------------------------------------------- ring attention, stepped


def attention_inputs(seq: int, heads: int = 4, head_size: int = 4, dtype=torch.float64) -> list[torch.Tensor]:
    """The whole sequence's q, k, v and an upstream gradient dL/dout: [1, nh, T, hs] each (seeded)."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, heads, seq, head_size)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4)]  # host: seeded draw


def attention_rank_fn(method: str, layout: str, causal: bool, seq: int) -> list[torch.Tensor]:
    """Rank code: ring or Ulysses attention, forward and backward, on this rank's block of the seeded inputs.
    Returns [out, dq, dk, dv], this rank's blocks."""
    rank, P = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (t.to(comm.device()) for t in attention_inputs(seq))  # drawn on the host, moved to the device
    mine = [sequence_split(t, rank, P, 2, layout).requires_grad_() for t in (q, k, v)]
    if method == "ulysses":
        out = ulysses_attention(*mine, causal=causal)
    else:
        out = ring_attention(*mine, causal=causal, layout=layout)
    (out * sequence_split(dout, rank, P, 2, layout)).sum().backward()
    return [out.detach()] + [t.grad for t in mine]


def attention_demo(
    method: str = "ring", world_size: int = 4, layout: str = "contiguous", causal: bool = True, seq: int = 16
) -> Results:
    """Run ring or Ulysses attention on `world_size` ranks (results[r] = [out, dq, dk, dv] of rank r's block);
    for ring attention the trace holds every tile span and every send/recv."""
    name = "ring-zigzag" if layout == "zigzag" else method
    SPOptions(world_size=world_size, seq=seq, heads=attention_inputs(seq)[0].shape[1], method=name).validate()
    return launch(attention_rank_fn, world_size, method, layout, causal, seq, echo=False)


def ring_demo(world_size: int = 4, layout: str = "contiguous", causal: bool = True, seq: int = 16) -> Results:
    """Run ring attention on `world_size` ranks; the trace holds every tile span and every send/recv."""
    return attention_demo("ring", world_size, layout, causal, seq)


def check_attention(results: Results, method: str, layout: str, causal: bool, seq: int = 16) -> list[Verdict]:
    """The ranks' blocks put back in sequence order against scaled_dot_product_attention on the whole sequence:
    output and the gradients of q, k, v."""
    q, k, v, dout = attention_inputs(seq)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (out * dout).sum().backward()
    merge = (lambda b: zigzag_merge(b, 2)) if layout == "zigzag" else (lambda b: torch.cat(b, 2))
    names = ("output", "dL/dq", "dL/dk", "dL/dv")
    return [
        compare(
            f"{method} ({layout}, causal={causal}) {name}",
            merge([r[i] for r in results]),
            ref,
            against="sdpa on the whole sequence",
        )
        for i, (name, ref) in enumerate(zip(names, (out.detach(), q.grad, k.grad, v.grad), strict=True))
    ]


def ring_steps(trace, world_size: int, layout: str, phase: str = "fwd") -> dict:
    """What the trace says happened at each ring step of one attention call (forward by default).

    held[s][r]: the rank whose K/V block rank r held at step s, followed through the trace's recvs: at step 0 its
    own; at step s what its s-th K/V recv brought, i.e. what the sender held at step s-1.
    tiles: (rank, step, q chunk, k chunk) of every tile span, in order.
    """
    P = world_size
    held = [list(range(P))]
    recvs = {r: [e for e in trace.select(kind="recv", rank=r) if e.label.startswith(f"kv {phase}")] for r in range(P)}
    for s in range(1, P):
        held.append([held[s - 1][recvs[r][s - 1].peer] for r in range(P)])
    tiles = [
        (e.rank, e.extra["ring_step"], e.extra["q"], e.extra["k"])
        for e in trace.select(kind="compute")
        if e.extra.get("attn") == phase
    ]
    return {"held": held, "tiles": tiles, "world_size": P, "layout": layout}


def tiles_per_rank(steps: dict) -> list[int]:
    counts = [0] * steps["world_size"]
    for rank, *_ in steps["tiles"]:
        counts[rank] += 1
    return counts


def draw_ring_step(steps: dict, step: int, causal: bool = True):
    """Left: the K/V block each rank holds at `step`. Right: the T x T score matrix in tiles, each done tile
    coloured by the rank that computed it (this step's with a thick border), skipped ones left white."""
    import plotly.graph_objects as go

    P, layout = steps["world_size"], steps["layout"]
    n = P * len(chunks_of(0, P, layout))  # tiles along each side of the score matrix
    x0 = 4.0  # where the tiles start
    kv_shapes, kv_notes = _kv_panel(steps, step, n)
    tile_shapes, tile_notes = _tile_panel(steps, step, n, x0, causal)
    fig = go.Figure()
    for r in range(P):
        fig.add_trace(square_legend(f"rank {r}", rank_color(r)))
    # Panel titles anchored away from each other (K/V ends at its panel's right edge, tiles start at their left
    # edge), on two lines: at any font size neither runs into the other.
    titles = [
        dict(x=2.6, y=n + 0.1, text="<b>K/V block</b><br><b>held</b>", xanchor="right"),
        dict(x=x0, y=n + 0.1, text="<b>score tiles done</b><br>(query row, key column)", xanchor="left"),
    ]
    titles = [dict(t, showarrow=False, yanchor="bottom", name="panel title") for t in titles]
    fig.update_layout(shapes=kv_shapes + tile_shapes, annotations=kv_notes + tile_notes + titles)
    chunk_ticks = [x0 + k + 0.5 for k in range(n)]
    fig.update_xaxes(range=[-1.2, x0 + n + 0.2], tickvals=chunk_ticks, ticktext=[f"k{k}" for k in range(n)])
    fig.update_yaxes(range=[-0.2, n + 1.5], showticklabels=False, scaleanchor="x")
    fig.update_xaxes(showgrid=False, zeroline=False)
    fig.update_yaxes(showgrid=False, zeroline=False)
    counts = [sum(1 for (rank, s, _, _) in steps["tiles"] if rank == r and s <= step) for r in range(P)]
    title = f"Ring attention ({layout}) on {P} ranks, step {step} of {P - 1}: tiles so far per rank {counts}"
    return style(fig, title, "key chunk", None, height=200 + 45 * n)


def _kv_panel(steps: dict, step: int, n: int) -> tuple[list, list]:
    """The K/V block each rank holds at `step`: one row per rank, coloured by the rank it came from."""
    P, layout = steps["world_size"], steps["layout"]
    shapes, notes = [], []
    for r in range(P):
        src, y = steps["held"][step][r], P - 1 - r
        shapes.append(_rect(0, y * n / P, 2.6, (y + 0.9) * n / P, rank_color(src)))
        held = ", ".join(f"c{c}" for c in chunks_of(src, P, layout))
        label = f"K/V of rank {src}<br>({held})"
        notes.append(dict(x=1.3, y=(y + 0.45) * n / P, text=label, showarrow=False, font={"color": "white"}))
        notes.append(dict(x=-0.1, y=(y + 0.45) * n / P, text=f"rank {r}", showarrow=False, xanchor="right"))
    return shapes, notes


def _tile_panel(steps: dict, step: int, n: int, x0: float, causal: bool) -> tuple[list, list]:
    """The n x n score tiles: done ones coloured by the rank that computed them, this step's with a thick border
    (drawn last, so that no neighbour covers it), skipped ones marked with a dot."""
    done = {(q, k): (rank, s) for rank, s, q, k in steps["tiles"] if s <= step}
    shapes, current, notes = [], [], []
    for q in range(n):
        y = n - 1 - q
        notes.append(dict(x=x0 - 0.1, y=y + 0.5, text=f"q{q}", showarrow=False, xanchor="right"))
        for k in range(n):
            who = done.get((q, k))
            now = who is not None and who[1] == step
            color = "white" if who is None else rank_color(who[0])
            (current if now else shapes).append(_rect(x0 + k, y, x0 + k + 1, y + 1, color, 3.5 if now else 0.6))
            if who is None and tile_mask(q, k, causal) == "skip":
                notes.append(dict(x=x0 + k + 0.5, y=y + 0.5, text="·", showarrow=False, font={"color": "#999"}))
    return shapes + current, notes


def _rect(x0, y0, x1, y1, color, width=0.6):
    return dict(type="rect", x0=x0, y0=y0, x1=x1, y1=y1, fillcolor=color, line={"color": "#333", "width": width})


# ------------------------------------------------------------------------------------- Ulysses' all-to-all


def ulysses_demo_rank_fn(heads: int, seq: int) -> dict:
    """Rank code: seq_to_heads on a tensor whose values name their place: 100 x sequence block + head."""
    rank, P = dist.get_rank(), dist.get_world_size()
    head = torch.arange(heads, dtype=torch.float64, device=comm.device()).view(1, heads, 1, 1)
    x = (100.0 * rank + head).expand(1, heads, seq // P, 1).contiguous()  # my block, all heads: [1, nh, T/P, 1]
    y = seq_to_heads(x)  # [1, nh/P, T, 1]
    return {"before": x[0, :, 0, 0], "after": y[0, :, :: seq // P, 0]}  # per head; per head and sequence block


def ulysses_demo(world_size: int = 4, heads: int = 4, seq: int = 8) -> Results:
    check_heads(heads, world_size)
    return launch(ulysses_demo_rank_fn, world_size, heads, seq, echo=False)


def draw_ulysses(results: Results):
    """Before: rank r holds sequence block r of every head. After: rank r holds every block of head group r.
    Each cell is coloured by the rank it came from (= its sequence block): the grid is transposed."""
    from parlab.views import plots

    P = len(results)
    before_t = [[f"s{int(v // 100)} h{int(v % 100)}" for v in res["before"].tolist()] for res in results]
    before_o = [[int(v // 100) for v in res["before"].tolist()] for res in results]
    after_t = [[f"s{int(v // 100)} h{int(v % 100)}" for v in res["after"].T.reshape(-1).tolist()] for res in results]
    after_o = [[int(v // 100) for v in res["after"].T.reshape(-1).tolist()] for res in results]
    title = f"Ulysses' all-to-all on {P} ranks: (sequence block s, head h) pieces, coloured by origin rank"
    fig = plots.chunk_grid(
        [
            ("before: my sequence block, all heads", before_t, before_o),
            ("after: all blocks, my heads", after_t, after_o),
        ],
        title,
    )
    return fig.update_xaxes(title_text="pieces each rank holds")


# ------------------------------------------------------------------------------------------- bytes vs theory


def comm_rows(reports: dict[str, dict]) -> list[tuple[str, str, int | float, int | float]]:
    """(method, what, measured per rank per step on rank 0, theory) for each method's attention traffic, in lesson
    00's two counts: a collective's payload (what the rank hands over) or the bytes on the wire (sent)."""
    rows = []
    for method, rep in reports.items():
        c = rep["comm"]
        if method == "megatron-sp":
            rows.append(
                (
                    method,
                    "all-gather payload, layers",
                    c["layers_all_gather_per_step"][0],
                    c["layers_theory"]["all_gather"],
                )
            )
            rows.append(
                (
                    method,
                    "reduce-scatter payload, layers",
                    c["layers_reduce_scatter_per_step"][0],
                    c["layers_theory"]["reduce_scatter"],
                )
            )
            rows.append(
                (method, "on the wire (ring), layers", c["layers_sent_per_step"][0], c["tp_all_reduce_sent_per_step"])
            )
        elif method == "ulysses":
            rows.append((method, "all-to-all payload", c["all_to_all_per_step"][0], c["all_to_all_per_step_theory"]))
        else:
            for item in ("kv fwd", "kv bwd", "dkv bwd"):
                rows.append(
                    (
                        method,
                        f"send {item} (payload = wire)",
                        c["send_per_step"][item][0],
                        c["send_per_step_theory"][item],
                    )
                )
        rows.append(
            (
                method,
                "gradient all-reduce payload",
                c["grad_all_reduce_per_step"][0],
                c["grad_all_reduce_per_step_theory"],
            )
        )
    return rows


def comm_figure(reports: dict[str, dict]):
    """Measured bytes per rank per training step (bars) beside the theory (markers), per method and item: payloads,
    and bytes sent on the wire where the item says so."""
    import plotly.graph_objects as go

    rows = comm_rows(reports)
    labels = [f"{m}: {what}" for m, what, _, _ in rows]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[r[2] for r in rows], name="measured (rank 0)", marker_color="#7B3294"))
    marker = {"symbol": "line-ew-open", "size": 30, "line": {"width": 3}, "color": "black"}
    fig.add_trace(go.Scatter(x=labels, y=[r[3] for r in rows], name="theory", mode="markers", marker=marker))
    P = next(iter(reports.values()))["world_size"]
    title = f"Communication per rank per training step, {P} ranks (payload, or bytes on the wire)"
    return style(fig, title, None, "bytes per rank per step", height=520)


# ------------------------------------------------------------------------------ memory vs sequence length

MEMORY_METHODS = ("single device", "megatron-sp", "ulysses", "ring")


def memory_config(seq: int, dtype: str = "float64") -> GPTConfig:
    return GPTConfig(vocab_size=64, seq_len=seq, hidden=32, heads=4, layers=1, dtype=dtype)


def activations_rank_fn(method: str, seqs: list[int], batch: int) -> dict[int, int]:
    """Rank code: saved activations (bytes) of one forward + loss of the GPT on this rank, per sequence length."""
    out, dev = {}, comm.device()
    for T in seqs:
        cfg = memory_config(T)
        full = build_model(cfg, device=dev)
        x, y = make_batches(cfg, batch, 1, device=dev)[0]
        if method == "megatron-sp":
            model = MegatronSPGPT(full)
            with saved_activations(exclude=model) as saved:
                model.loss(x, y)
        else:
            model = SequenceShardedGPT(full, method)
            idx, targets, positions = shard_batch(x, y, method)
            with saved_activations(exclude=model) as saved:
                model.loss(idx, targets, positions, T)
        out[T] = saved.bytes
    return out


def measure_activations(world_size: int = 4, seqs=(16, 32, 64, 128), batch: int = 1) -> dict[str, list[int]]:
    """Saved activations per rank (rank 0; bytes) at each sequence length, for one device and each method."""
    for T in seqs:
        for method in ("megatron-sp", "ulysses", "ring"):
            SPOptions(world_size=world_size, seq=T, method=method, layers=1).validate()
    measured = {}
    single = []
    for T in seqs:
        cfg = memory_config(T)
        model = build_model(cfg)
        x, y = make_batches(cfg, batch, 1)[0]
        with saved_activations(exclude=model) as saved:
            lm_loss(model(x), y)
        single.append(saved.bytes)
    measured["single device"] = single
    for method in MEMORY_METHODS[1:]:
        results = launch(activations_rank_fn, world_size, method, list(seqs), batch, echo=False)
        measured[method] = [results[0][T] for T in seqs]
    return measured


def memory_figure(measured: dict[str, list[int]], seqs, world_size: int):
    """Saved activations per rank against sequence length (log-log): attention scores grow as T^2 except in
    ring attention, whose tiles are freed as it goes."""
    import plotly.graph_objects as go

    colors = {"single device": "#000000", "megatron-sp": "#E69F00", "ulysses": "#009E73", "ring": "#0072B2"}
    fig = go.Figure()
    for method, values in measured.items():
        fig.add_trace(
            go.Scatter(
                x=list(seqs),
                y=values,
                name=method,
                mode="lines+markers",
                line={"color": colors[method]},
                hovertemplate="T=%{x}: %{y} bytes<extra>" + method + "</extra>",
            )
        )
    fig.update_xaxes(type="log", tickvals=list(seqs))
    fig.update_yaxes(type="log")
    title = f"Activation memory per rank (saved for backward, 1 layer), {world_size} ranks"
    return style(fig, title, "sequence length T (tokens)", "bytes (rank 0)", height=480)


# ------------------------------------------------------------------------------- USP: Ulysses x ring on a mesh


def usp_demo_rank_fn(ulysses: int, ring: int, heads: int, seq: int, layout: str) -> dict:
    """Rank code: a tensor whose values name their place (1000 x head + token position), split as USP splits it,
    then the ulysses axis' all-to-all: which (head, token) pairs this rank holds between and inside attention."""
    from parlab.core.mesh import DeviceMesh
    from parlab.schemes.sequence.usp import usp_mesh_axes, usp_split

    mesh = DeviceMesh(usp_mesh_axes(ulysses, ring))
    g, u = mesh.index("ring"), mesh.index("ulysses")
    dev = comm.device()
    place = 1000.0 * torch.arange(heads, device=dev).view(1, heads, 1, 1) + torch.arange(seq, device=dev).view(
        1, 1, seq, 1
    )
    mine = usp_split(place.to(torch.float64), g, u, ring, ulysses, 2, layout).contiguous()  # [1, nh, T/P, 1]
    inside = seq_to_heads(mine, group=mesh.group("ulysses"))  # [1, nh/U, T/R, 1]: what the ring attention sees
    return {"between": mine.flatten().tolist(), "inside": inside.flatten().tolist()}


def usp_demo(ulysses: int = 2, ring: int = 2, heads: int = 2, seq: int = 16, layout: str = "zigzag") -> Results:
    from parlab.schemes.sequence.usp import check_usp

    check_usp(heads, seq, ulysses, ring, ulysses * ring, layout)
    return launch(usp_demo_rank_fn, ulysses * ring, ulysses, ring, heads, seq, layout, echo=False)


def usp_holders(results: Results, heads: int, seq: int, when: str) -> list[list[int]]:
    """holder[h][t]: the rank holding token t of head h, `when` "between" or "inside" attention (from the run)."""
    holder = [[-1] * seq for _ in range(heads)]
    for rank, held in enumerate(results):
        for value in held[when]:
            holder[int(value) // 1000][int(value) % 1000] = rank
    return holder


GAP = 5  # columns between the two maps (room for the head labels)


def draw_usp(results: Results, ulysses: int, ring: int, heads: int, seq: int, layout: str):
    """Two maps of heads x tokens, each cell coloured by the rank that holds it: between attention calls (every
    head of its T/P tokens) and inside attention (its nh/U heads of its ring block, after the all-to-all)."""
    import plotly.graph_objects as go

    P, shapes, notes = ulysses * ring, [], []
    for k, when in enumerate(("between", "inside")):
        holder, x0 = usp_holders(results, heads, seq, when), k * (seq + GAP)
        inside = "<b>inside attention (after the all-to-all)</b><br>nh/U heads of a ring block (T/R tokens)"
        title = "<b>between attention calls</b><br>every head of T/P tokens" if when == "between" else inside
        notes.append(dict(x=x0 + seq / 2, y=heads + 0.1, text=title, showarrow=False, yanchor="bottom"))
        for h in range(heads):
            notes.append(dict(x=x0 - 0.2, y=heads - h - 0.5, text=f"head {h}", showarrow=False, xanchor="right"))
            for t in range(seq):
                shapes.append(_rect(x0 + t, heads - h - 1, x0 + t + 1, heads - h, rank_color(holder[h][t])))
    fig = go.Figure()
    for r in range(P):
        fig.add_trace(square_legend(f"rank {r} (ring {r // ulysses}, ulysses {r % ulysses})", rank_color(r)))
    fig.update_layout(shapes=shapes, annotations=notes)
    every = max(1, seq // ring // ulysses)  # a tick per T/P tokens
    ticks = [(k * (seq + GAP) + t + 0.5, str(t)) for k in range(2) for t in range(0, seq, every)]
    fig.update_xaxes(
        range=[-3, 2 * seq + GAP + 0.5],
        tickvals=[x for x, _ in ticks],
        ticktext=[t for _, t in ticks],
        showgrid=False,
        zeroline=False,
    )
    fig.update_yaxes(range=[-0.3, heads + 1.2], showticklabels=False, showgrid=False, zeroline=False)
    title = f"USP, ulysses {ulysses} x ring {ring} ({layout}), {heads} heads, T = {seq}: who holds which (head, token)"
    return style(fig, title, "token position", None, height=260 + 40 * heads)


def usp_comm_rows(reports: dict[str, dict]) -> list[tuple[str, int | float, int | float]]:
    """(method, all-to-all payload, ring send bytes) per rank per training step (rank 0), from run reports of
    ulysses, ring and usp."""
    rows = []
    for method, rep in reports.items():
        c = rep["comm"]
        if method == "usp":
            rows.append((f"usp {rep['ulysses']}x{rep['ring']}", c["ulysses_per_step"][0], c["ring_per_step"][0]))
        elif method == "ulysses":
            rows.append((method, c["all_to_all_per_step"][0], 0))
        elif method.startswith("ring"):
            rows.append((method, 0, sum(v[0] for v in c["send_per_step"].values())))
    return rows


def usp_comm_figure(reports: dict[str, dict]):
    """Bytes per rank per training step on each kind of link: all-to-all (the ulysses axis) and ring sends."""
    import plotly.graph_objects as go

    rows = usp_comm_rows(reports)
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=[r[0] for r in rows],
            y=[r[1] for r in rows],
            name="all-to-all payload (ulysses axis)",
            marker_color="#009E73",
        )
    )
    fig.add_trace(
        go.Bar(x=[r[0] for r in rows], y=[r[2] for r in rows], name="ring sends (ring axis)", marker_color="#0072B2")
    )
    fig.update_layout(barmode="stack")
    return style(fig, "Measured bytes per rank per training step, 4 ranks", None, "bytes per rank per step", height=420)
