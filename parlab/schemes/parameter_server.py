"""A parameter server: one rank holds the parameters, the others compute gradients, synchronously or not.

Notation (lesson 08): P ranks in `group`; rank 0 is the SERVER, ranks 1..P-1 are the N = P-1 WORKERS; a global
batch of B rows, b = B/N rows per worker; Psi parameters, G = grad_bytes = Psi x bytes per element; K steps.
theta_v is the server's parameter vector after v updates (its VERSION v; theta_0 = the initial weights).

The design of DistBelief's Downpour SGD (Dean et al. 2012) and of Li et al.'s parameter server (OSDI 2014):
the parameters live on a server; each worker PULLS them, computes a gradient on its own rows, and PUSHES it back.

    worker w (the same code in both modes)          server (rank 0)
      pull:  recv theta_v      <--------------------  send theta_v to w                      G bytes
      forward + backward on its b rows -> g_w
      push:  send g_w          -------------------->  recv g_w                               G bytes

  * synchronous (`run_sync_server`): the server waits for the gradients of ALL N workers, averages them,
    g = (1/N) sum_w g_w, takes one optimizer step and sends theta_{v+1} to everyone. With the same global batch
    split over the workers this is exactly all-reduce data parallelism (parlab/schemes/data_parallel.py), and exactly
    one device on the whole batch (float64, <= 1e-10): the average of N means over b rows is the mean over B rows.
  * asynchronous (`run_async_server`): the server applies each worker's gradient AS IT ARRIVES,
    theta_{v+1} = theta_v - lr * g_w, and sends the new parameters back to that worker only. Nobody waits for
    anybody, but g_w was computed on the version theta_r that w read, not on theta_v: its STALENESS is
    tau = v - r, the number of updates applied since w read its parameters (Hogwild!/Downpour's price).

Stragglers: a worker slowed by a factor F (`straggle`: it sleeps (F-1) x its measured compute time, in a span on the
timeline). Synchronous training - server or all-reduce (`train_all_reduce_dp`, beside it here) - runs at the pace
of the slowest worker; asynchronous training does not wait, and pays in staleness instead.

Traffic (measured by parlab.core.comm; `ps_theory`): per step each worker sends G and receives G; the server sends N x G
and receives N x G: its link carries N times a worker's, and becomes the bottleneck as workers are added
(`bottleneck_workers`). A ring all-reduce over the N workers puts 2(N-1)/N x G on each rank's link each way
(about 2 G), whatever N is.

Point to point only: every message here is a traced send/recv (parlab.core.comm) between the server and one worker.
The asynchronous server receives from ANY worker (torch.distributed's any-source receive, `recv_from_any`); NCCL
has none, so asynchronous mode runs on gloo (CPU).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from parlab.core import comm
from parlab.core.models import lm_loss
from parlab.schemes.data_parallel import shard_batch

MODES = ("sync", "async")
SERVER = 0  # the server is rank 0 of the group; ranks 1..P-1 of the group are workers


def check_setup(world_size: int, straggler: int | None = None, slowdown: float = 1.0, batch: int | None = None):
    """Raise a clear ValueError for a setup that cannot work (called before any process starts, and by the ranks).

    straggler: the rank (of the group) to slow down, a worker 1..P-1, or None. slowdown: its factor F >= 1.
    batch: the global batch B, split over the N = P-1 workers."""
    P = world_size
    if P < 2:
        raise ValueError(f"world_size={P}: a parameter server needs at least 2 ranks (rank 0 serves, 1.. work)")
    if slowdown < 1:
        raise ValueError(f"slowdown={slowdown} must be >= 1 (the straggler takes slowdown x its compute time)")
    if straggler is not None:
        if straggler == SERVER:
            raise ValueError(f"straggler={straggler} is the server; the straggler must be a worker, 1..{P - 1}")
        if not 1 <= straggler <= P - 1:
            raise ValueError(f"straggler={straggler} does not exist: the workers are ranks 1..{P - 1} (world_size={P})")
    elif slowdown != 1:
        raise ValueError(f"slowdown={slowdown} needs a straggler: name the worker to slow down (1..{P - 1})")
    if batch is not None and batch % (P - 1):
        raise ValueError(f"global batch={batch} is not divisible by the {P - 1} workers (world_size={P} - 1 server)")


# ------------------------------------------------------------------------ one flat vector of Psi numbers


def params_to_vector(model: nn.Module) -> torch.Tensor:
    """The parameters side by side, in model.parameters() order: a new tensor [Psi]."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def vector_to_params(vector: torch.Tensor, model: nn.Module) -> None:
    """Copy a [Psi] vector into the model's parameters (the inverse of params_to_vector)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def grads_to_vector(model: nn.Module) -> torch.Tensor:
    """The gradients side by side: a new tensor [Psi] (zeros for a parameter without a gradient)."""
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in model.parameters()])


def vector_to_grads(vector: torch.Tensor, model: nn.Module) -> None:
    """Set every p.grad from a [Psi] vector (what the optimizer then reads)."""
    offset = 0
    for p in model.parameters():
        p.grad = vector[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


# ------------------------------------------------------------------------------------------------ stragglers


def straggle(compute_seconds: float, slowdown: float, step: int) -> None:
    """Make this rank a straggler: after `compute_seconds` of real work, idle (slowdown - 1) x as long, so its
    step takes `slowdown` x its compute time. The wait is a span on the timeline ("straggler x3")."""
    if slowdown > 1:
        with comm.span(f"straggler x{slowdown:g}", kind="compute", step=step, straggler=True):
            time.sleep((slowdown - 1) * compute_seconds)


def compute_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, step: int, slowdown: float):
    """Forward and backward on rows x, y ([b, T] each), then straggle; returns the loss (a float)."""
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    with comm.span("forward", kind="forward", step=step):
        loss = loss_fn(model, x, y)  # the mean loss over these b rows
    with comm.span("backward", kind="backward", step=step):
        loss.backward()  # p.grad = g_w: the gradient of that mean
    straggle(time.perf_counter() - start, slowdown, step)
    return loss.item()


# ------------------------------------------------------------------------------------------------- the worker


def run_worker(model: nn.Module, batches, *, slowdown: float = 1.0, group=None, loss_fn=None) -> dict:
    """Worker rank code (ranks 1..P-1 of the group), the same in both modes: K times pull, compute, push; then
    one last pull (so that every worker ends with the server's parameters of that moment).

    batches: the GLOBAL batches [B, T]; worker w (rank w of the group) trains on rows [(w-1)b, wb) of each.
    slowdown: this worker's own factor (1: not a straggler)."""
    P, rank = comm.group_size(group), comm.group_rank(group)
    N, server = P - 1, comm.global_rank(group, SERVER)
    theta = params_to_vector(model)  # [Psi]: the buffer the pulls land in
    losses = []
    for step, (x, y) in enumerate(batches):
        comm.recv(theta, server, group=group, label="pull params")  # theta <- theta_v from the server
        vector_to_params(theta, model)
        x_w, y_w = shard_batch(x, y, rank - 1, N)  # [b, T] each: this worker's rows
        losses.append(compute_gradient(model, x_w, y_w, loss_fn, step, slowdown))
        comm.send(grads_to_vector(model), server, group=group, label=f"push grad {step}")  # g_w [Psi] -> server
        comm.progress(step + 1, len(batches))
    comm.recv(theta, server, group=group, label="pull params")  # the last pull
    vector_to_params(theta, model)
    return {"losses": losses}


# ------------------------------------------------------------------------------------------------ the servers


def run_sync_server(model, optimizer, steps: int, *, group=None, keep_history: bool = False) -> dict:
    """Synchronous server rank code: K times {send theta_v to every worker; wait for ALL N gradients; average;
    one optimizer step}, then send the final parameters to every worker.

    Returns "updates": one record per gradient RECEIVED (N per step, each read version v and averaged into the
    update applied at version v: staleness 0); "applied": the updates APPLIED (one per step: K); the time of each
    update, and with keep_history the parameter vector of every version (history[v] = theta_v)."""
    P = comm.group_size(group)
    N, workers = P - 1, range(1, P)
    theta = params_to_vector(model)  # theta_0 [Psi]
    grads = {w: torch.empty_like(theta) for w in workers}  # one receive buffer [Psi] per worker
    history, updates, times, applied = [theta], [], [], 0
    for step in range(steps):
        for w in workers:  # the server's link carries N pulls of G bytes...
            comm.send(theta, comm.global_rank(group, w), group=group, label=f"params v{step} to {w}")
        works = [comm.irecv(grads[w], comm.global_rank(group, w), group=group, label=f"grad from {w}") for w in workers]
        comm.wait_all(works)  # ... and N pushes of G bytes; this waits for the slowest worker
        with comm.span("average, update", kind="optimizer", step=step):
            g = sum(grads[w] for w in workers) / N  # (1/N) sum_w g_w, summed in worker order [Psi]
            vector_to_grads(g, model)
            optimizer.step()  # theta_{v+1} = theta_v - lr g (SGD): ONE update for the N gradients
            theta = params_to_vector(model)
        applied += 1
        times.append(time.perf_counter())
        updates += [{"worker": w, "step": step, "read_version": step, "staleness": 0} for w in workers]
        if keep_history:
            history.append(theta)
    for w in workers:
        comm.send(theta, comm.global_rank(group, w), group=group, label=f"params v{steps} to {w}")
    return {"updates": updates, "applied": applied, "update_times": times, "history": history if keep_history else None}


def recv_from_any(buffer: torch.Tensor, group=None, label: str = "") -> int:
    """Receive into `buffer` from whichever rank of `group` sends first; returns the sender's rank in the group.

    This is torch.distributed's any-source receive (dist.recv(buffer, src=None)), made through parlab.core.comm so that
    it is traced; the event names the sender once it is known."""
    sender = comm.recv(buffer, None, group=group, label=label)  # src=None: from any rank; the sender's global rank
    return sender if group is None else dist.get_group_rank(group, sender)


def run_async_server(model, optimizer, steps: int, *, group=None, keep_history: bool = False) -> dict:
    """Asynchronous server rank code: send theta_0 to every worker; then apply each gradient as it arrives,
    from whichever worker sends it, and send the new parameters back to that worker only.

    Every worker pushes K gradients, so the server receives N x K gradients and applies each as one update:
    "applied" = N x K. For each it records ("updates") the worker, that worker's step, the version r the worker had
    read, and the staleness tau = v - r (v: the version the update is applied to, i.e. updates applied so far)."""
    P = comm.group_size(group)
    N, workers = P - 1, range(1, P)
    theta = params_to_vector(model)  # theta_0 [Psi]
    read_version = {w: 0 for w in workers}  # the version each worker last pulled
    pushes = {w: 0 for w in workers}  # gradients received from each worker so far
    for w in workers:
        comm.send(theta, comm.global_rank(group, w), group=group, label=f"params v0 to {w}")
    g = torch.empty_like(theta)  # [Psi]: the receive buffer
    history, updates, times, applied = [theta], [], [], 0
    for v in range(N * steps):  # v updates applied so far: theta is theta_v
        w = recv_from_any(g, group=group, label="grad from any worker")
        tau = v - read_version[w]  # updates applied since w read its parameters
        with comm.span(f"update v{v + 1}", kind="optimizer", step=v, worker=w, staleness=tau):
            vector_to_grads(g, model)
            optimizer.step()  # theta_{v+1} = theta_v - lr g_w, g_w computed at theta_{v - tau}
            theta = params_to_vector(model)
        applied += 1
        times.append(time.perf_counter())
        updates.append({"worker": w, "step": pushes[w], "read_version": read_version[w], "staleness": tau})
        pushes[w] += 1
        comm.send(theta, comm.global_rank(group, w), group=group, label=f"params v{v + 1} to {w}")
        read_version[w] = v + 1
        if keep_history:
            history.append(theta)
    return {"updates": updates, "applied": applied, "update_times": times, "history": history if keep_history else None}


# ---------------------------------------------------------------------------------------- the training loop


def train_parameter_server(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    mode: str = "sync",
    straggler: int | None = None,
    slowdown: float = 1.0,
    group=None,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    keep_history: bool = False,
) -> dict:
    """Rank code: train with a parameter server on rank 0 of `group` (default all ranks), workers on the others.

    model, optimizer: the same initial weights on every rank (only the server's count: workers pull them).
    batches: the GLOBAL batches [B, T], the same list on every rank; B must be divisible by N = P-1.
    mode: "sync" or "async". straggler: the worker (rank of the group) slowed by `slowdown`, or None.
    loss_fn(model, x, y): the mean loss of rows x (default: the GPT's next-token loss).

    Returns, on the server: role "server", the gradients received (worker, step, read_version, staleness), the
    number of updates applied (sync: K, one per step; async: N x K, one per gradient), their times, the final
    parameters (and with keep_history, history[v] = theta_v); on a worker: role "worker", its
    losses (per step, mean over its rows), its final parameters."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    P, rank = comm.group_size(group), comm.group_rank(group)
    check_setup(P, straggler, slowdown, batches[0][0].shape[0])
    loss_fn = loss_fn or (lambda model, x, y: lm_loss(model(x), y))
    start = time.perf_counter()
    if rank == SERVER:
        serve = run_sync_server if mode == "sync" else run_async_server
        out = {"role": "server", **serve(model, optimizer, len(batches), group=group, keep_history=keep_history)}
    else:
        own = slowdown if rank == straggler else 1.0
        out = {"role": "worker", **run_worker(model, batches, slowdown=own, group=group, loss_fn=loss_fn)}
    out["start"], out["end"] = start, time.perf_counter()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# -------------------------------------------------------------------------- beside it: all-reduce DP, no server


def train_all_reduce_dp(model, optimizer, batches, *, slowdown: float = 1.0, group=None, loss_fn=None) -> dict:
    """Rank code for the N workers without a server: each computes g_w on its rows, one all-reduce of the flat
    gradient (sum over the group, then / N), and every rank takes the same step. The same numbers as the
    synchronous server (the same rows per worker); no link carries more than ~2 G per step, but every rank still
    waits for the slowest. slowdown: this rank's own factor (1: not a straggler)."""
    N, w = comm.group_size(group), comm.group_rank(group)
    loss_fn = loss_fn or (lambda model, x, y: lm_loss(model(x), y))
    losses, start = [], time.perf_counter()
    for step, (x, y) in enumerate(batches):
        x_w, y_w = shard_batch(x, y, w, N)  # [b, T] each: the same rows as worker w+1 of the server's group
        losses.append(compute_gradient(model, x_w, y_w, loss_fn, step, slowdown))
        g = grads_to_vector(model)  # [Psi]
        comm.all_reduce(g, group=group, label="gradient")  # g <- sum_w g_w, on every rank; waits for the slowest
        g /= N
        with comm.span("update", kind="optimizer", step=step):
            vector_to_grads(g, model)
            optimizer.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "start": start, "end": time.perf_counter()}


# ------------------------------------------------------------------------ what an asynchronous run computed


def replay_on_one_device(model, optimizer, batches, updates: list[dict], workers: int, loss_fn=None) -> dict:
    """Redo an asynchronous run on one device, in the order its server applied the updates.

    An asynchronous run is not repeatable (which gradient arrives first depends on timing), but given its record
    it is exact: update u took worker w's rows of batch `step`, computed at version theta_r (r = read_version),
    and applied it to theta_u. model, optimizer: fresh, with the run's initial weights. Returns the parameters
    after the last update and the loss each gradient was computed at, {(worker, step): loss}."""
    loss_fn = loss_fn or (lambda model, x, y: lm_loss(model(x), y))
    reader = copy.deepcopy(model)  # the worker's copy, loaded with the version it read
    versions = [params_to_vector(model)]  # versions[v] = theta_v
    losses = {}
    for u in updates:
        vector_to_params(versions[u["read_version"]], reader)
        x, y = batches[u["step"]]
        x_w, y_w = shard_batch(x, y, u["worker"] - 1, workers)
        reader.zero_grad(set_to_none=True)
        loss = loss_fn(reader, x_w, y_w)
        loss.backward()
        losses[(u["worker"], u["step"])] = loss.item()
        vector_to_grads(grads_to_vector(reader), model)
        optimizer.step()
        versions.append(params_to_vector(model))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses}


# ------------------------------------------------------------------------------------------------- the theory


def ps_theory(grad_bytes: int, world_size: int, steps: int) -> dict:
    """What the parameter server moves (both modes), from the protocol: each worker K pushes and K+1 pulls of
    G bytes; the server the same for each of the N workers. Beside it, a ring all-reduce over the N workers."""
    G, N, K = grad_bytes, world_size - 1, steps
    worker = (2 * K + 1) * G  # sent + received by one worker over the run
    return {
        "theory_worker_bytes": worker,
        "theory_server_bytes": N * worker,  # N times a worker's: every message has the server at one end
        "theory_worker_bytes_per_step": 2 * G,  # one push, one pull
        "theory_server_bytes_per_step": 2 * N * G,
        "theory_ring_sent_bytes_per_step": 2 * (N - 1) * G / N,  # each way, on every rank (~2 G)
    }


def bottleneck_workers(grad_bytes: int, compute_seconds: float, link_bytes_per_second: float) -> float:
    """How many workers a server can feed before its link is the bottleneck.

    Per synchronous step the server's link moves 2 N G bytes (N pulls and N pushes, one after another):
    2 N G / beta seconds, beta = link_bytes_per_second. A worker needs compute_seconds t_c plus its own 2 G / beta.
    The server is the slower side once 2 N G / beta > t_c + 2 G / beta, i.e. when N > 1 + t_c beta / (2 G)."""
    return 1 + compute_seconds * link_bytes_per_second / (2 * grad_bytes)
