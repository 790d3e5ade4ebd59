"""Failures: a rank that dies mid-step, and training that survives it (from a sharded checkpoint, or without it).

Rank code here, orchestration in parlab/runs/checkpoint.py, the lesson in notebooks/11_fault_tolerance.ipynb.

    resumable_rank   DP or ZeRO training that saves a sharded checkpoint every C steps (checkpoint.py here),
                     resumes from the newest one, and - if this is the rank chosen to fail - dies in the middle of
                     step `at_step` (os._exit: no exception, no cleanup, no goodbye: as a crashed process)
    async_server_with_failures
                     the asynchronous parameter server, which notices that a worker fell silent (no gradient for
                     `heartbeat` seconds) and carries on with the others

What happens to synchronous training when a rank dies: its peers wait in the next collective that needs it.
parlab.launch sees the process exit, stops the others and names the rank (a RankError); a real cluster sees a
timeout (NCCL's watchdog, torchrun's agent) instead. The job then restarts from the last complete checkpoint, on
the survivors: P-1 ranks, so the sharded state is resharded as it is loaded.

The arithmetic of failures (the lesson's first part):
    a job on n devices fails n times as often as one device:        MTBF_job = MTBF_device / n
    checkpoint every tau seconds, a save costs delta seconds: Young (1974): tau* = sqrt(2 delta MTBF_job)
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn

from parlab.core import comm
from parlab.core.models import build_model, lm_loss, make_optimizer
from parlab.schemes.data_parallel import all_reduce_gradients, shard_batch
from parlab.schemes.faults import checkpoint as ckpt
from parlab.schemes.parameter_server import params_to_vector, vector_to_grads
from parlab.schemes.zero.stages import ZeRO

DIED_FILE = "died.json"  # written by the dying rank just before it exits: when, and in which step
KILLED_EXIT_CODE = 43  # the exit status of a rank killed on purpose (any non-zero code is a failure to launch)


@dataclass
class FaultPlan:
    """Where checkpoints go, how often, and who dies when (kill_rank None: nobody).

    at_step is 1-based: the rank dies in the middle of step at_step (after its forward pass), steps 1..at_step-1
    done. every: a checkpoint after every `every` completed steps (0: never)."""

    root: str
    every: int = 2
    kill_rank: int | None = None
    at_step: int = 0
    resume: bool = False


def die(rank: int, step: int, root: str) -> None:
    """Rank code: die now, as a crashed process does (os._exit: no exception, no finally, no message)."""
    Path(root, DIED_FILE).write_text(json.dumps({"rank": rank, "step": step, "time": time.time()}))
    os._exit(KILLED_EXIT_CODE)


def resumable_rank(
    scheme: str,
    cfg,
    batches,
    plan: FaultPlan,
    *,
    seed: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.1,
    stage: int = 0,
    rows: int | None = None,
) -> dict:
    """Rank code: DP (scheme "dp") or ZeRO (scheme "zero", `stage`) training with sharded checkpoints.

    batches: the global batches [B, T] of the whole run (the same on every rank); rows: use only the first `rows`
    rows of each (a smaller global batch after losing a rank), split among this launch's P ranks.
    Returns the losses of the steps it ran, the step it started from, the final parameters (whole), when it was
    ready to train (time.time(), after loading), and what its checkpoints cost (bytes it wrote, seconds)."""
    P, rank, dev = comm.group_size(), comm.group_rank(), comm.device()
    batches = [(x.to(dev), y.to(dev)) for x, y in batches]  # they came from the parent, on the host
    model = build_model(cfg, seed, device=dev)
    trainer, pieces, layout, t_of = _trainer(scheme, model, stage, optimizer, lr)
    start, read = 0, 0
    folder = ckpt.latest(plan.root) if plan.resume else None
    if folder is not None:  # every rank reads the parts of the checkpoint it holds now (resharding)
        reader = ckpt.Reader(folder)
        ckpt.load_zero(reader, trainer) if scheme == "zero" else ckpt.load_dp(reader, model, trainer)
        start, read = reader.step, reader.bytes_read
    ready = time.time()
    losses, saves = [], []
    for k in range(start, len(batches)):  # step k+1
        x, y = batches[k]
        x_r, y_r = shard_batch(x[:rows], y[:rows], rank, P)  # [b, T] each
        with comm.span("forward", kind="forward", step=k):
            loss = lm_loss(model(x_r), y_r)
        if rank == plan.kill_rank and k + 1 == plan.at_step:
            die(rank, k + 1, plan.root)  # mid-step: the others will wait for this rank's gradients in vain
        with comm.span("backward", kind="backward", step=k):
            loss.backward()  # ZeRO 2, 3: reduce-scatters start in here
        if scheme == "zero":
            trainer.step(k)
            trainer.zero_grad()
        else:
            all_reduce_gradients(model)  # p.grad = (1/P) sum_r g_r
            with comm.span("optimizer step", kind="optimizer", step=k):
                trainer.step()
            trainer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if plan.every and (k + 1) % plan.every == 0 and k + 1 < len(batches):
            saves.append(_save(plan.root, k, pieces(), layout, t_of()))
        comm.progress(k + 1, len(batches))
    params = trainer.full_params() if scheme == "zero" else {n: p.detach().clone() for n, p in model.named_parameters()}
    if scheme == "zero":
        trainer.remove()
    return {"losses": losses, "start": start, "params": params, "ready": ready, "saves": saves, "bytes_read": read}


def _trainer(scheme: str, model, stage: int, optimizer: str, lr: float):
    """(the optimizer, this rank's checkpoint pieces, their layout, its step count): ZeRO's, or DP's."""
    if scheme == "zero":
        zero = ZeRO(model, stage, lr=lr)
        return zero, (lambda: ckpt.zero_pieces(zero)), f"zero-{stage}", (lambda: zero.t)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    return opt, (lambda: ckpt.dp_pieces(model, opt)), "dp", (lambda: ckpt.optimizer_step(opt))


def _save(root: str, k: int, pieces: list, layout: str, optimizer_step: int) -> dict:
    """This rank's part of the checkpoint after step k+1 (parlab/schemes/faults/checkpoint.py), and what it cost."""
    began = time.perf_counter()
    with comm.span(f"checkpoint {k + 1}", kind="compute", step=k):
        ckpt.save(root, k + 1, pieces, layout=layout, extra={"optimizer_step": optimizer_step})
    written = sum(p.data.numel() * p.data.element_size() for p in pieces)
    return {"step": k + 1, "seconds": time.perf_counter() - began, "bytes": written}


# -------------------------------------------------------------------- the asynchronous server, workers may die


def async_server_with_failures(model: nn.Module, optimizer, steps: int, *, heartbeat: float = 1.0, group=None) -> dict:
    """The asynchronous parameter server (parlab/schemes/parameter_server.py's run_async_server), made to survive a
    worker that falls silent: when no gradient at all arrives for `heartbeat` seconds, the workers that still owe
    gradients are declared dead and the server stops waiting for them. The others never notice: nobody waits for
    anybody, so the dead worker is only missed once it is the last one the server could wait for.

    group: the ranks (default all; under NCCL a gloo group of all ranks: only gloo receives from any source).
    Returns the updates (worker, its step, staleness), the workers declared dead (when, after how long)."""
    P = comm.group_size(group)
    workers = range(1, P)
    theta = params_to_vector(model)  # theta_0 [Psi]
    read_version, pushes = {w: 0 for w in workers}, {w: 0 for w in workers}
    last_seen = {w: time.time() for w in workers}
    for w in workers:
        comm.send(theta, comm.global_rank(group, w), group=group, label=f"params v0 to {w}")
    g = torch.empty_like(theta)  # [Psi]: the receive buffer
    updates, dead, v = [], {}, 0
    owing = lambda: [w for w in workers if pushes[w] < steps and w not in dead]  # noqa: E731
    while owing():
        work = comm.irecv(g, None, group=group, label="grad from any worker")  # from whichever worker sends first
        try:  # gloo completes an any-source receive only inside wait(): wait, but no longer than the heartbeat
            work.work.wait(timeout=timedelta(seconds=heartbeat if updates else 600))  # (first: start-up)
        except RuntimeError:  # nobody sent for `heartbeat` seconds: whoever still owes gradients is dead
            now = time.time()
            for w in owing():
                dead[w] = {"declared": now, "silent_for": now - last_seen[w], "after_pushes": pushes[w]}
            break
        work.event.end = time.perf_counter()  # the traced receive ends here (a second wait() would block in gloo)
        w = work.work._source_rank()  # the sender (its rank in the group): gloo says who it was
        tau = v - read_version[w]  # updates applied since w read its parameters
        with comm.span(f"update v{v + 1}", kind="optimizer", step=v, worker=w, staleness=tau):
            vector_to_grads(g, model)
            optimizer.step()
            theta = params_to_vector(model)
        updates.append({"worker": w, "step": pushes[w], "read_version": read_version[w], "staleness": tau})
        pushes[w] += 1
        last_seen[w] = time.time()
        comm.send(theta, comm.global_rank(group, w), group=group, label=f"params v{v + 1} to {w}")
        read_version[w], v = v + 1, v + 1
    return {
        "role": "server",
        "updates": updates,
        "applied": v,
        "dead": dead,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


# ------------------------------------------------------------------------------------------------- the theory


def job_mtbf(device_mtbf_hours: float, devices: int) -> float:
    """Hours between failures of a job that stops when any of its `devices` fails (independent failures)."""
    return device_mtbf_hours / devices


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's (1974) checkpoint interval: tau* = sqrt(2 delta M), delta the save's cost, M the job's MTBF."""
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def wasted_fraction(interval: float, save_seconds: float, mtbf_seconds: float) -> float:
    """The fraction of time lost, first order: saving (delta / tau) plus redoing half an interval per failure
    (tau / 2M). Young's tau* is its minimum."""
    return save_seconds / interval + interval / (2 * mtbf_seconds)
