"""Lesson 08 (notebooks/08_parameter_server.ipynb): the figures and measurements around the parameter server.

The scheme (servers, worker, stragglers, all-reduce DP beside it, theory) is in parlab/schemes/parameter_server.py, and
`parlab.runs.parameter_server.run_ps` runs and checks it; this module draws what runs did:

    one phase of a run        `phase_trace`: the server's run, or the all-reduce DP run after it
    the traffic               `draw_traffic`: bytes at the server, at each worker, at an all-reduce rank
    the timelines             `draw_timeline`: plots.timeline of one phase (straggler delays as compute spans)
    staleness                 `draw_staleness`: how stale the applied gradients were, by worker
    convergence               `draw_loss_curves`: sync vs async, by updates applied or by seconds
    the server's limit        `bottleneck_sweep`, `draw_bottleneck`: measured at 2..8 ranks, beside the formula
    the exercise              `check_prediction`, `exercise_answer`: a student's prediction checked, the answer
                              shown only on request

Bytes (lesson 00's two counts): every parameter-server message is a send/recv, whose payload is what goes on the
wire; the figures add what a rank sends and what it receives. An all-reduce's figure is its payload.
"""

from __future__ import annotations

from parlab.core.trace import Trace
from parlab.runtime.errors import Results
from parlab.schemes.parameter_server import bottleneck_workers


def phase_trace(results: Results, phase: str = "ps") -> Trace:
    """The events of one phase of a `run_ps` run: "ps" (the parameter server) or "dp" (all-reduce DP over the
    workers, which runs after it). Each rank's events between its own start and end of that phase."""
    events = []
    for rank, out in enumerate(results):
        window = out if phase == "ps" else out.get("dp")
        if window is None:  # the server takes no part in all-reduce DP
            continue
        events += [e for e in results.trace.select(rank=rank) if window["start"] <= e.start <= window["end"]]
    return Trace(events, results.trace.world_size)


def draw_timeline(results: Results, title: str, phase: str = "ps", steps: int | None = None):
    """Plotly timeline of one phase (parlab.views.plots.timeline): forward, backward, the straggler's delay and the
    server's updates above; pulls, pushes (send/recv) or all-reduces below. Times measured in the ranks.

    steps: draw only the beginning of the run, until the server has applied `steps` x (updates per synchronous
    step) updates ("ps": 1 per step in sync mode, N in async mode) or worker 1 has finished `steps` all-reduces
    ("dp")."""
    from parlab.views import plots

    trace = phase_trace(results, phase)
    if steps is not None:
        if phase == "ps":
            times = results[0]["update_times"]  # sync: one per step; async: one per gradient (N per "step")
            asynchronous = len(times) == len(results[0]["updates"])
            index = steps * (len(results) - 1) if asynchronous else steps
            cutoff = times[min(index, len(times)) - 1]
        else:
            reduces = [e.end for e in trace.select(kind="all_reduce", rank=1)]
            cutoff = reduces[min(steps, len(reduces)) - 1]
        trace = Trace([e for e in trace.events if e.start <= cutoff], trace.world_size)
    return plots.timeline(trace, title, show_labels=False)


def traffic_table(report: dict) -> list[tuple[str, str, float]]:
    """(bar, what, bytes) over the whole run: measured parameter-server bytes (sent + received) at the server and
    at each worker; beside them, a ring all-reduce over the same workers (theory, sent + received) and the
    all-reduce payload each worker handed to torch.distributed (measured, when the run had --dp)."""
    N, K = report["workers"], report["steps"]
    rows = [("server", "parameter server, measured", report["server_bytes"])]
    rows += [(f"worker {w}", "parameter server, measured", b) for w, b in enumerate(report["worker_bytes"], 1)]
    ring = 2 * report["comm"]["theory_ring_sent_bytes_per_step"] * K
    rows += [(f"DP rank {w}", "ring all-reduce, sent + received (theory)", ring) for w in range(1, N + 1)]
    if "all_reduce_per_step" in report["comm"]:
        rows += [
            (f"DP rank {w}", "all-reduce payload (measured)", b * K)
            for w, b in enumerate(report["comm"]["all_reduce_per_step"], 1)
        ]
    return rows


def draw_traffic(report: dict):
    """Plotly bars: the bytes each rank's link carried over the run, parameter server vs all-reduce DP."""
    import plotly.graph_objects as go

    from parlab.views import plots

    rows = traffic_table(report)
    G, K, N = report["grad_bytes"], report["steps"], report["workers"]
    colors = {
        "parameter server, measured": plots.SERIES_COLORS["parlab"],
        "ring all-reduce, sent + received (theory)": plots.KIND_COLORS["all_reduce"],
        "all-reduce payload (measured)": plots.KIND_COLORS["reduce_scatter"],
    }
    unit_of = {  # lesson 00's two counts: what went over the link, or what was handed to the all-reduce
        "parameter server, measured": " sent + received (send/recv: the payload is on the wire)",
        "ring all-reduce, sent + received (theory)": " sent + received on the wire",
        "all-reduce payload (measured)": " handed to the all-reduce (its payload)",
    }
    fig = go.Figure()
    for what, color in colors.items():
        mine = [(bar, b) for bar, w, b in rows if w == what]
        if not mine:
            continue
        fig.add_trace(
            go.Bar(
                name=what,
                x=[bar for bar, _ in mine],
                y=[b / 1e6 for _, b in mine],
                marker={"color": color},
                hovertemplate=[
                    f"{bar}<br>{b:,.0f} bytes = {b / G:.2f} G{unit_of[what]}<extra>{what}</extra>" for bar, b in mine
                ],
            )
        )
    fig.update_layout(barmode="group")
    title = f"Bytes over {K} steps, {N} workers: the server carries {N} x a worker's (G = {G:,} bytes)"
    return plots.style(fig, title, None, "MB sent + received")


def draw_staleness(report: dict):
    """Plotly histogram: how many updates were applied with each staleness, stacked by worker."""
    import plotly.graph_objects as go

    from parlab.views import plots

    updates = report["updates"]
    fig = go.Figure()
    for w in range(1, report["workers"] + 1):
        taus = [u["staleness"] for u in updates if u["worker"] == w]
        slow = " (straggler)" if w == report.get("straggler") else ""
        fig.add_trace(
            go.Histogram(
                x=taus,
                name=f"worker {w}{slow}",
                marker={"color": plots.rank_color(w)},
                xbins={"start": -0.5, "size": 1},
                hovertemplate=f"worker {w}<br>staleness %{{x}}<br>%{{y}} updates<extra></extra>",
            )
        )
    fig.update_layout(barmode="stack")
    fig.update_xaxes(dtick=1)
    title = f"Staleness of the {len(updates)} asynchronous updates (updates applied since the worker read)"
    return plots.style(fig, title, "staleness tau (updates)", "updates")


def draw_loss_curves(reports: dict[str, dict], x: str = "updates"):
    """Plotly curves: the loss of the server's parameters on a fixed batch after each update, for each report
    (e.g. {"sync": ..., "async": ...}); x = "updates" (updates applied) or "seconds" (when, on the server)."""
    import plotly.graph_objects as go

    from parlab.views import plots

    colors = {"sync": plots.SERIES_COLORS["single device"], "async": plots.SERIES_COLORS["parlab"]}
    fig = go.Figure()
    for name, report in reports.items():
        losses = report["eval_losses"]  # theta_0, theta_1, ...
        xs = list(range(len(losses))) if x == "updates" else [0.0] + [t * 1e3 for t in report["update_seconds"]]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=losses,
                name=name,
                mode="lines+markers",
                line={"color": colors.get(name)},
                hovertemplate=f"{name}<br>%{{x}}<br>loss %{{y:.6f}}<extra></extra>",
            )
        )
    axis = "updates applied by the server" if x == "updates" else "time since the server started (ms)"
    return plots.style(fig, f"Loss on a fixed batch, by {x}", axis, "cross-entropy loss (nats)")


def bottleneck_sweep(worlds=range(2, 9), steps: int = 3, rows_per_worker: int = 2) -> list[dict]:
    """Synchronous parameter server at each world size (rows_per_worker rows for each of the N = P-1 workers:
    every worker does the same work at every size). Measured per step: the server's bytes, its seconds in sends
    (the pulls: the workers are already waiting), a worker's compute seconds, the step time."""
    from parlab.runs.parameter_server import run_ps

    rows = []
    for P in worlds:
        N = P - 1
        results, report = run_ps(P, "sync", steps=steps, batch=rows_per_worker * N, dp=False)
        trace = results.trace
        sends = trace.select(kind="send", rank=0)
        compute = [e for e in trace.select(compute=True) if e.rank > 0 and e.kind in ("forward", "backward")]
        times = report["update_seconds"]
        rows.append(
            {
                "world_size": P,
                "workers": N,
                "grad_bytes": report["grad_bytes"],
                "server_bytes_per_step": report["comm"]["server_bytes_per_step"],
                "worker_bytes_per_step": report["comm"]["worker_bytes_per_step"],
                "ring_bytes_per_step": 2 * report["comm"]["theory_ring_sent_bytes_per_step"],
                "link_bytes_per_second": sum(e.bytes for e in sends) / sum(e.duration for e in sends),
                "compute_seconds": sum(e.duration for e in compute) / (N * steps),
                "step_seconds": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else times[0],
                "passed": report["passed"],
            }
        )
    for row in rows:
        row["server_link_seconds"] = row["server_bytes_per_step"] / row["link_bytes_per_second"]
        row["bottleneck_workers"] = bottleneck_workers(
            row["grad_bytes"], row["compute_seconds"], row["link_bytes_per_second"]
        )
    return rows


def draw_bottleneck(rows: list[dict]):
    """Plotly, two panels: bytes per step against the number of workers (server vs worker vs ring all-reduce
    rank), and measured seconds per step (the server's link time, a worker's compute, the whole step)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from parlab.views import plots

    N = [r["workers"] for r in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("bytes per step", "seconds per step (measured)"))
    series = [
        (1, "server (parameter server)", [r["server_bytes_per_step"] / 1e6 for r in rows], plots.RANK_COLORS[0]),
        (1, "a worker (parameter server)", [r["worker_bytes_per_step"] / 1e6 for r in rows], plots.RANK_COLORS[1]),
        (1, "a ring all-reduce rank (theory)", [r["ring_bytes_per_step"] / 1e6 for r in rows], "#54A24B"),
        (2, "server link: 2NG / beta", [r["server_link_seconds"] * 1e3 for r in rows], plots.RANK_COLORS[0]),
        (2, "a worker's compute t_c", [r["compute_seconds"] * 1e3 for r in rows], plots.RANK_COLORS[1]),
        (2, "step time", [r["step_seconds"] * 1e3 for r in rows], "#000000"),
    ]
    for col, name, ys, color in series:
        unit = "MB" if col == 1 else "ms"
        fig.add_trace(
            go.Scatter(
                x=N,
                y=ys,
                name=name,
                mode="lines+markers",
                line={"color": color, "dash": "dot" if "theory" in name else "solid"},
                hovertemplate=f"{name}<br>%{{x}} workers<br>%{{y:.3f}} {unit}<extra></extra>",
            ),
            row=1,
            col=col,
        )
    fig.update_xaxes(title_text="workers N = P - 1", dtick=1)
    fig.update_yaxes(title_text="MB sent + received", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=2)
    return plots.style(fig, "Adding workers: the server's link grows with N, a ring rank's does not", height=480)


# ------------------------------------------------------------------------------------------------ the exercise


def check_prediction(prediction: int | None, report: dict) -> str:
    """Exercise 1 of lesson 08: the student's prediction of the server's bytes (sent + received over the run, as a
    multiple of G) against the run's measured figure, without giving the figure away when it is wrong."""
    measured = report["server_bytes"] / report["grad_bytes"]
    if prediction is None:
        return "No prediction yet: put yours in my_prediction above and run both cells again."
    if prediction == measured:
        return f"Your prediction, {prediction} x G: right, the server sent + received exactly that."
    return (
        f"Your prediction, {prediction} x G: not what the server sent + received. Count, per step, the messages "
        "with the server at one end, then the last pull; try again, or reveal the answer below."
    )


def exercise_answer(report: dict) -> str:
    """Exercise 1's answer with its reasoning, from a run's report (measured) beside the protocol's count."""
    G, N, K = report["grad_bytes"], report["workers"], report["steps"]
    server, worker = report["server_bytes"] // G, report["worker_bytes"][0] // G
    return (
        f"server: {server} x G measured = N (2K+1) = {N} x {2 * K + 1} in theory: per step it sends theta to each of "
        f"the N = {N} workers and receives each one's gradient (2N messages of G), K = {K} times, plus one last "
        f"pull per worker. Each worker: {worker} x G = 2K+1. The server's link carries N = {N} times a worker's."
    )
