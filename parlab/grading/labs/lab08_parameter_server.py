"""Lab 08's checks: a synchronous parameter server, the staleness of the gradients a server applied, read from
its log, and an asynchronous server with bounded staleness, on live ranks (see parlab/grading).

The ranks: rank 0 runs the student's server on the flat parameter vector theta [Psi] of the reference GPT; ranks
1..N run parlab's own worker (parlab.schemes.parameter_server.run_worker: K times pull theta, compute the gradient of
its b = B/N rows, push it; then one last pull). Worker 3 is a straggler (it idles twice its compute time every step).
What the server did is read from its own traced calls (parlab.core.comm: every send and receive, in program order, with
its peer), and what it computed is checked by replaying the run on one device in the order it applied the
gradients.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.check import check_equal, compare
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches, make_optimizer
from parlab.grading.labs import prediction_lines, run_check
from parlab.schemes.data_parallel import shard_batch
from parlab.schemes.parameter_server import (
    grads_to_vector,
    params_to_vector,
    run_worker,
    train_parameter_server,
    vector_to_params,
)

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a reply never sent) stops after 60 s
CFG = GPTConfig()  # the reference GPT: float64, Psi = 30,080 parameters
P, B, STEPS, LR = 4, 6, 3, 0.1  # ranks (rank 0 serves, 3 workers), global batch rows, steps, SGD's learning rate
N = P - 1  # workers
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T]: worker w trains on rows [(w-1)b, wb)
STRAGGLER, SLOWDOWN = 3, 3.0  # worker 3 takes 3 x its compute time every step
SSP_STEPS, SSP_BOUNDS = 4, (0, 1)  # the bounded-staleness check: K = 4 steps, at s = 0 and s = 1
SSP_BATCHES = make_batches(CFG, B, SSP_STEPS, seed=1)
PREDICT_STEPS = 4

STRUCTURAL = {
    "sync": "3 workers, 3 steps of SGD: the server's parameters, every worker's last pull and the mean loss of each "
    "step equal one device on the whole batch (sync = large-batch SGD); the server sent theta to each worker K+1 "
    "times and received K gradients from each, G bytes each, and never sent theta_{v+1} before it had all N "
    "gradients of step v",
    "sync_updates": "parlab.schemes.parameter_server's own synchronous run (3 workers, 4 steps): the updates it "
    "applied, the gradients it received and the bytes through its link, against theory and the prediction",
    "staleness": "the staleness of every gradient in the logs of real runs (parlab's synchronous and asynchronous "
    "servers with a straggler) and of three written logs, against the judge's own reading of each log",
    "ssp": "at s = 0 and s = 1 with a straggler: the one-device replay of the run in the server's order equals the "
    "server's final parameters, the loss of every gradient and every worker's last pull; every reply to a worker's "
    "c-th push was sent once, after that push, when every worker had pushed at least c - s gradients, and at the "
    "first receive it could (no reply held longer); N x K gradients applied, K per worker",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ------------------------------------------------------------------------------------------------ the ranks


def next_token_loss(model, x, y) -> torch.Tensor:
    """The GPT's mean next-token loss of rows x: [b, T] (y: x shifted by one)."""
    return lm_loss(model(x), y)


def run_server_and_workers(server, batches, *args) -> dict:
    """Rank code: rank 0 calls server(theta_0, K, LR, *args) on the flat parameters [Psi] and returns its final
    theta and its traced messages; ranks 1..N run parlab's worker (worker STRAGGLER slowed by SLOWDOWN)."""
    rank = dist.get_rank()
    model = build_model(CFG, seed=0)  # theta_0, the same on every rank
    if rank == 0:
        start = len(comm.trace_events())
        with probe.recording(keep_sent_data=False) as calls:
            theta = server(params_to_vector(model), len(batches), LR, *args)
        messages = [[e.kind, e.peer, e.bytes] for e in comm.trace_events()[start:] if e.kind in ("send", "recv")]
        sent = sum(c["op"] == "send" for c in calls)
        received = sum(c["op"] in ("recv", "recv_anysource") for c in calls)
        return {"theta": theta.detach().clone(), "messages": messages, "pg_messages": [sent, received]}
    slowdown = SLOWDOWN if rank == STRAGGLER else 1.0
    out = run_worker(model, batches, slowdown=slowdown, loss_fn=next_token_loss)
    return {"losses": torch.tensor(out["losses"], dtype=torch.float64), "theta": params_to_vector(model)}


# ------------------------------------------------------------------------------------------------ one device


def gradient_at(theta: torch.Tensor, batch, worker: int | None = None) -> tuple[torch.Tensor, float]:
    """The gradient [Psi] and the loss of the GPT at parameters theta on a batch's rows (worker w's rows, or all)."""
    model = build_model(CFG, seed=0)
    vector_to_params(theta, model)
    x, y = batch
    if worker is not None:
        x, y = shard_batch(x, y, worker - 1, N)  # [b, T]
    loss = lm_loss(model(x), y)
    loss.backward()
    return grads_to_vector(model), loss.item()


@functools.lru_cache(maxsize=1)  # the same reference for every notebook graded
def one_device_sgd() -> tuple[list[torch.Tensor], list[float]]:
    """One device, the whole batch, SGD by hand: theta_v for v = 0..K and the loss of each step."""
    theta, versions, losses = params_to_vector(build_model(CFG, seed=0)), [], []
    for batch in BATCHES:
        versions.append(theta)
        g, loss = gradient_at(theta, batch)
        losses.append(loss)
        theta = theta - LR * g
    versions.append(theta)
    return versions, losses


# ------------------------------------------------------------------------------------------------ the checks


def collect_sync(sync_server) -> dict:
    return {"ranks": list(parlab.launch(run_server_and_workers, P, sync_server, BATCHES, **LAUNCH))}


def _through_comm(server: dict) -> list[str]:
    sent = sum(kind == "send" for kind, _, _ in server["messages"])
    received = sum(kind == "recv" for kind, _, _ in server["messages"])
    ok = [sent, received] == list(server["pg_messages"])
    return [f"server: every message it sent and received went through parlab.core.comm: {'PASS' if ok else 'FAIL'}"]


def judge_sync(data) -> list[str]:
    ranks = data["ranks"]
    server, workers = ranks[0], ranks[1:]
    versions, losses = one_device_sgd()
    K, G = STEPS, versions[0].numel() * 8
    mean_loss = torch.stack([w["losses"] for w in workers]).mean(dim=0)  # each worker's loss: the mean of b rows
    lines = [
        compare(f"server: parameters after {K} steps", server["theta"], versions[K]).line,
        compare(
            "loss of each step, the mean over the workers",
            mean_loss,
            torch.tensor(losses, dtype=torch.float64),
        ).line,
        compare("every worker's last pull", [w["theta"] for w in workers], [versions[K]] * N).line,
    ]
    lines += _through_comm(server)
    messages = server["messages"]
    for w in range(1, P):
        mine = [m for m in messages if m[1] == w]
        sent = sum(b for kind, _, b in mine if kind == "send")
        received = sum(b for kind, _, b in mine if kind == "recv")
        lines.append(check_equal(f"server: bytes sent to worker {w} (theta, K+1 times)", sent, (K + 1) * G).line)
        lines.append(check_equal(f"server: bytes received from worker {w} (K gradients)", received, K * G).line)
    # Synchrony: the j-th theta sent to any worker comes after j gradients from every worker.
    pushes, early = dict.fromkeys(range(1, P), 0), 0
    sends = dict.fromkeys(range(1, P), 0)
    for kind, peer, _ in messages:
        if kind == "recv" and peer in pushes:
            pushes[peer] += 1
        elif kind == "send" and peer in sends:
            early += min(pushes.values()) < sends[peer]
            sends[peer] += 1
    lines.append(check_equal("server: theta_{v+1} sent before all N gradients of step v had arrived", early, 0).line)
    return lines


# ---- the prediction: parlab's own synchronous server


def _library_sync(batches) -> dict:
    model = build_model(CFG, seed=0)
    out = train_parameter_server(model, make_optimizer(model.parameters(), "sgd", LR), batches, mode="sync")
    if out["role"] != "server":
        return {}
    return {"applied": len(out["update_times"]), "gradients": len(out["updates"])}  # one time per update


def collect_sync_updates(updates, gradients, server_bytes) -> dict:
    batches = make_batches(CFG, B, PREDICT_STEPS, seed=0)
    results = parlab.launch(_library_sync, P, batches, **LAUNCH)
    carried = sum(e.bytes for e in results.trace.events if e.rank == 0 and e.kind in ("send", "recv"))
    return {"predicted": [updates, gradients, server_bytes], **results[0], "server_bytes": carried}


def judge_sync_updates(data) -> list[str]:
    K, G = PREDICT_STEPS, sum(p.numel() for p in build_model(CFG).parameters()) * 8
    updates, gradients, server_bytes = data["predicted"]
    lines = prediction_lines(f"updates the server applies in {K} steps", updates, K, data["applied"])
    lines += prediction_lines(f"gradients the server receives in {K} steps", gradients, N * K, data["gradients"])
    lines += prediction_lines(
        "bytes through the server's link (sent + received)", server_bytes, N * (2 * K + 1) * G, data["server_bytes"]
    )
    return lines


# ---- staleness, read from a server's log


def server_log(messages: list, updates: list[int] | None = None) -> list[tuple[str, int]]:
    """A server's log from its traced messages: ("pull", w) for theta sent to w, ("push", w) for a gradient
    received from w, ("update", 0) where the server applied an update. updates: after how many messages each
    update came (None: one update right after every gradient received, as an asynchronous server does)."""
    log = []
    for i, (kind, peer, _) in enumerate(messages):
        log.append(("pull" if kind == "send" else "push", int(peer)))
        if updates is None and kind == "recv":
            log.append(("update", 0))
        elif updates is not None:
            log += [("update", 0)] * updates.count(i + 1)
    return log


def read_staleness(log: list[tuple[str, int]]) -> list[int]:
    """The judge's reading of a log: for each push, in order, (version it was applied at) - (version pulled)."""
    version, pulled, waiting, out = 0, {}, [], []
    for what, w in log:
        if what == "pull":
            pulled[w] = version
        elif what == "push":
            waiting.append(len(out))
            out.append(pulled[w])
        elif what == "update":
            for i in waiting:
                out[i] = version - out[i]
            waiting, version = [], version + 1
    return out


WRITTEN_LOGS = {
    "two gradients per update, a pull between them": [
        ("pull", 1),
        ("pull", 2),
        ("push", 2),
        ("pull", 2),
        ("push", 1),
        ("update", 0),
        ("push", 2),
        ("pull", 1),
        ("update", 0),
        ("pull", 2),
        ("push", 1),
        ("update", 0),
    ],
    "a worker pulls twice before it pushes": [
        ("pull", 1),
        ("pull", 2),
        ("push", 1),
        ("update", 0),
        ("pull", 1),
        ("pull", 1),
        ("push", 2),
        ("update", 0),
        ("push", 1),
        ("update", 0),
    ],
    "four workers, one slow": [
        *[("pull", w) for w in (1, 2, 3, 4)],
        *[e for w in (1, 2, 3) for e in (("push", w), ("update", 0), ("pull", w))],
        *[e for w in (2, 1, 3, 2) for e in (("push", w), ("update", 0), ("pull", w))],
        ("push", 4),
        ("update", 0),
    ],
}


def _library_runs(batches) -> dict:
    """Rank code: parlab's synchronous then asynchronous server, worker STRAGGLER slowed; the server's messages
    and where its updates came."""
    out = {}
    for mode in ("sync", "async"):
        model = build_model(CFG, seed=0)
        start = len(comm.trace_events())
        result = train_parameter_server(
            model,
            make_optimizer(model.parameters(), "sgd", LR),
            batches,
            mode=mode,
            straggler=STRAGGLER,
            slowdown=SLOWDOWN,
        )
        if result["role"] != "server":
            continue
        messages, updates = [], []
        for e in comm.trace_events()[start:]:
            if e.kind in ("send", "recv"):
                messages.append([e.kind, int(e.peer), e.bytes])
            elif e.kind == "optimizer":
                updates.append(len(messages))
        out[mode] = {"messages": messages, "updates": updates if mode == "sync" else None}
    return out


def collect_staleness(staleness) -> dict:
    runs = parlab.launch(_library_runs, P, BATCHES, **LAUNCH)[0]
    logs = {
        f"parlab's synchronous server, worker {STRAGGLER} a straggler": server_log(**runs["sync"]),
        f"parlab's asynchronous server, worker {STRAGGLER} a straggler": server_log(**runs["async"]),
        **WRITTEN_LOGS,
    }
    answers = {}
    for what, log in logs.items():
        try:
            answers[what] = [int(x) for x in staleness([tuple(e) for e in log])]
        except Exception as error:  # one log's error fails that log's line, not the others
            answers[what] = f"{type(error).__name__}: {error}"
    return {"logs": {what: [list(e) for e in log] for what, log in logs.items()}, "answers": answers}


def judge_staleness(data) -> list[str]:
    lines = []
    for what, log in data["logs"].items():
        expected, got = read_staleness([tuple(e) for e in log]), data["answers"][what]
        n = len(expected)
        if isinstance(got, str):
            lines.append(f"{what}: the staleness of each of the {n} gradients ({got[:80]}): FAIL")
        elif got == expected:
            lines.append(f"{what}: the staleness of each of the {n} gradients: PASS")
        else:
            first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), n))
            mine = got[first] if first < len(got) else "none"
            theirs = expected[first] if first < n else "none"
            lines.append(
                f"{what}: the staleness of each of the {n} gradients ({len(got)} given; gradient {first}: "
                f"yours {mine}, the log's {theirs}): FAIL"
            )
    return lines


# ---- bounded staleness


def run_ssp(ssp_server, batches) -> dict:
    """Rank code: the server with each staleness bound s in SSP_BOUNDS, one run after the other."""
    return {s: run_server_and_workers(ssp_server, batches, s) for s in SSP_BOUNDS}


def collect_ssp(ssp_server) -> dict:
    results = parlab.launch(run_ssp, P, ssp_server, SSP_BATCHES, **LAUNCH)
    return {"runs": {str(s): [r[s] for r in results] for s in SSP_BOUNDS}}


def replay(order: list[int], reads: dict[tuple[int, int], int]) -> dict:
    """The run on one device: gradient u is worker order[u]'s c-th (its rows of batch c), computed at theta_r,
    r = reads[(w, c)], applied to theta_u. Returns every version theta_v and the loss of every gradient."""
    theta, versions, losses, done = params_to_vector(build_model(CFG, seed=0)), [], {}, {}
    for w in order:
        versions.append(theta)
        c = done.get(w, 0)
        r = reads.get((w, c))
        if r is None or r >= len(versions):
            return {"error": f"worker {w}'s gradient {c} was computed on parameters not yet sent"}
        g, losses[(w, c)] = gradient_at(versions[r], SSP_BATCHES[c], w)
        theta = theta - LR * g
        done[w] = c + 1
    versions.append(theta)
    return {"versions": versions, "losses": losses}


def _judge_ssp_run(s: int, ranks: list[dict]) -> list[str]:
    K, server = SSP_STEPS, ranks[0]
    messages = server["messages"]
    tag = f"s={s}"
    lines = _through_comm(server)
    lines[0] = f"{tag}: {lines[0]}"
    order = [int(peer) for kind, peer, _ in messages if kind == "recv" and peer is not None]
    per_worker = [order.count(w) for w in range(1, P)]
    verdict = "PASS" if per_worker == [K] * N else "FAIL"
    lines.append(f"{tag}: gradients applied from workers 1..{N}: {per_worker}, K = {K} each: {verdict}")
    # Replies: the c-th theta sent to w (c = 0: before any push) at the moment of `received` gradients.
    received, pushes, sent = 0, dict.fromkeys(range(1, P), 0), dict.fromkeys(range(1, P), 0)
    reads, broken, late, history = {}, 0, 0, [dict(pushes)]  # history[i]: pushes per worker after i receives
    for kind, peer, _ in messages:
        if kind == "recv":
            received += 1
            if peer in pushes:
                pushes[peer] += 1
            history.append(dict(pushes))
            continue
        if peer not in sent:
            broken += 1
            continue
        c = sent[peer]
        sent[peer] += 1
        reads[(peer, c)] = received
        if c == 0:
            broken += received != 0  # theta_0 goes to every worker before any gradient arrives
            continue
        broken += pushes[peer] != c or min(pushes.values()) < c - s  # the reply to w's c-th push, and allowed
        # the first moment it was allowed: w had pushed c gradients and every worker at least c - s
        first = next((i for i, h in enumerate(history) if h[peer] >= c and min(h.values()) >= c - s), None)
        late += first is not None and first < received
    lines.append(
        check_equal(
            f"{tag}: replies sent before the worker's push, or before every worker had pushed c - s gradients",
            broken,
            0,
        ).line
    )
    lines.append(check_equal(f"{tag}: replies held past the first receive after which they were allowed", late, 0).line)
    complete = all(sent[w] == K + 1 for w in sent) and per_worker == [K] * N
    lines.append(f"{tag}: each worker's K+1 pulls answered: {'PASS' if complete else 'FAIL'}")
    if not complete:
        return lines
    result = replay(order, reads)
    if "error" in result:
        return [*lines, f"{tag}: one-device replay ({result['error']}): FAIL"]
    versions, against = result["versions"], "one-device replay in the server's order"
    ours = torch.tensor([ranks[w]["losses"][c] for w in range(1, P) for c in range(K)], dtype=torch.float64)
    theirs = torch.tensor([result["losses"][(w, c)] for w in range(1, P) for c in range(K)], dtype=torch.float64)
    last = [versions[reads[(w, K)]] for w in range(1, P)]
    tau = [reads_at - reads[(w, c)] for reads_at, (w, c) in _applied(order, reads)]
    bound = (N - 1) * (2 * s + 1)
    lines += [
        compare(
            f"{tag}: server's parameters after {N * K} gradients",
            server["theta"],
            versions[-1],
            against=against,
        ).line,
        compare(
            f"{tag}: loss of each of the {N * K} gradients, as the workers computed it",
            ours,
            theirs,
            against=against,
        ).line,
        compare(
            f"{tag}: every worker's last pull",
            [ranks[w]["theta"] for w in range(1, P)],
            last,
            against=against,
        ).line,
        f"{tag}: every gradient's staleness within (N-1)(2s+1) = {bound}: {'PASS' if max(tau) <= bound else 'FAIL'}",
    ]
    return lines


def _applied(order: list[int], reads: dict) -> list[tuple[int, tuple[int, int]]]:
    """(version it was applied at, (worker, its gradient number)) of each gradient, in the server's order."""
    done, out = {}, []
    for v, w in enumerate(order):
        c = done.get(w, 0)
        out.append((v, (w, c)))
        done[w] = c + 1
    return out


def judge_ssp(data) -> list[str]:
    lines = []
    for s in SSP_BOUNDS:
        lines += _judge_ssp_run(s, data["runs"][str(s)])
    return lines


# ---- not graded: what each mode does about a straggler (the lab's last cell)


def _straggler_rank(ssp_server, s: int, batches, slowdown: float) -> dict:
    out, rank = {}, dist.get_rank()
    for mode in ("sync", "async", f"ssp s={s}"):
        model = build_model(CFG, seed=0)
        comm.barrier()
        start, first = time.perf_counter(), len(comm.trace_events())
        if mode.startswith("ssp"):
            if rank == 0:
                ssp_server(params_to_vector(model), len(batches), LR, s)
            else:
                run_worker(model, batches, slowdown=slowdown if rank == STRAGGLER else 1.0, loss_fn=next_token_loss)
        else:
            optimizer = make_optimizer(model.parameters(), "sgd", LR)
            train_parameter_server(model, optimizer, batches, mode=mode, straggler=STRAGGLER, slowdown=slowdown)
        messages, updates = [], []
        for e in comm.trace_events()[first:]:
            if e.kind in ("send", "recv"):
                messages.append([e.kind, int(e.peer), e.bytes])
            elif e.kind == "optimizer":
                updates.append(len(messages))
        log = server_log(messages, updates if mode == "sync" else None)
        out[mode] = {"log": log, "seconds": time.perf_counter() - start}
    return out


def straggler_runs(ssp_server, s: int = 1, steps: int = 8, slowdown: float = 8.0) -> dict:
    """Not graded: parlab's synchronous and asynchronous servers and your ssp_server(s), one after the other, with
    worker STRAGGLER `slowdown` x slower; per mode, the server's log and its seconds (measured, not repeatable)."""
    batches = make_batches(CFG, B, steps, seed=2)
    return parlab.launch(_straggler_rank, P, ssp_server, s, batches, slowdown, **LAUNCH)[0]
