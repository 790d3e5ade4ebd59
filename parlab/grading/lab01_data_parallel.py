"""Lab 01's checks: the student's batch sharding and gradient averaging, on live ranks (see parlab/grading)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.check import check_equal, compare
from parlab.data_parallel import shard_batch as library_shard
from parlab.grading import probe, run_check
from parlab.models import (
    GPTConfig,
    build_model,
    lm_loss,
    make_batches,
    make_optimizer,
    param_bytes,
    train_single_device,
)

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
CFG = GPTConfig()  # the reference GPT: 2 layers, hidden 32, float64
B, STEPS = 8, 3  # global batch rows, training steps
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T] token ids

STRUCTURAL = {
    "shard": "the rows of the 4 ranks, in rank order, are exactly the global batch; B=6 on 4 ranks raises ValueError",
    "average": "each rank all-reduces exactly one copy of the gradients (bytes counted at the process group)",
    "training": "3 steps of naive DP on 2 ranks: the averaged loss and every parameter match one device",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def train_dp(shard, average, batches, seed: int = 0, lr: float = 0.1) -> dict:
    """Rank code: naive DP. batches: the global batches, the same list on every rank."""
    P, r = dist.get_world_size(), dist.get_rank()
    model = build_model(CFG, seed)  # the same weights on every rank
    opt = make_optimizer(model.parameters(), "sgd", lr)
    losses = []
    for x, y in batches:
        x_r, y_r = shard(x, y, r, P)  # [B/P, T]
        opt.zero_grad()
        loss = lm_loss(model(x_r), y_r)  # the mean over this rank's rows
        loss.backward()
        average(model)
        opt.step()
        losses.append(loss.item())
    return {"losses": torch.tensor(losses, dtype=torch.float64), "params": dict(model.named_parameters())}


# ------------------------------------------------------------------------------------------------ the checks


def _run_shard(shard, x, y) -> dict:
    x_r, y_r = shard(x, y, dist.get_rank(), dist.get_world_size())
    return {"x": x_r, "y": y_r}


def collect_shard(shard_batch) -> dict:
    x, y = BATCHES[0]
    results = parlab.launch(_run_shard, 4, shard_batch, x, y, **LAUNCH)
    try:
        shard_batch(x[:6], y[:6], 0, 4)
        raises = False
    except ValueError:
        raises = True
    return {"ranks": list(results), "raises_on_uneven": raises}


def judge_shard(data) -> list[str]:
    ranks, (x, y) = data["ranks"], BATCHES[0]
    return [
        compare("x rows of ranks 0..3, concatenated", torch.cat([res["x"] for res in ranks]), x, show=False).line,
        compare("y rows of ranks 0..3, concatenated", torch.cat([res["y"] for res in ranks]), y, show=False).line,
        check_equal("rows on each rank (the fewest)", min(len(res["x"]) for res in ranks), B // 4, show=False).line,
        f"B=6 on 4 ranks raises ValueError: {'PASS' if data['raises_on_uneven'] is True else 'FAIL'}",
    ]


def _run_average(average, x, y) -> dict:
    P, r = dist.get_world_size(), dist.get_rank()
    model = build_model(CFG, seed=0)
    x_r, y_r = library_shard(x, y, r, P)  # [B/P, T]: this check does not depend on your shard_batch
    lm_loss(model(x_r), y_r).backward()
    with probe.recording(keep_sent_data=False) as calls:
        average(model)
    return {"grads": {n: p.grad for n, p in model.named_parameters()}, "calls": calls}


def collect_average(average_gradients) -> dict:
    return {"ranks": list(parlab.launch(_run_average, 4, average_gradients, *BATCHES[0], **LAUNCH))}


def judge_average(data) -> list[str]:
    ranks = data["ranks"]
    reference = train_single_device(CFG, BATCHES[:1], seed=0).grads  # the whole batch on one device
    lines = [
        compare(f"rank {r}: gradients after averaging", ranks[r]["grads"], reference, show=False).line for r in range(4)
    ]
    grad_bytes = param_bytes(build_model(CFG))
    for r in range(4):
        sent = probe.total_bytes(ranks[r]["calls"], "allreduce")
        lines.append(
            check_equal(f"rank {r}: bytes all-reduced (one copy of the gradients)", sent, grad_bytes, show=False).line
        )
    return lines


def collect_training(shard_batch, average_gradients) -> dict:
    return {"ranks": list(parlab.launch(train_dp, 2, shard_batch, average_gradients, BATCHES, **LAUNCH))}


def judge_training(data) -> list[str]:
    ranks = data["ranks"]
    reference = train_single_device(CFG, BATCHES, seed=0, lr=0.1)
    mean_loss = torch.stack([res["losses"] for res in ranks]).mean(dim=0)  # each rank's loss is over B/P rows
    losses = torch.tensor(reference.losses, dtype=torch.float64)
    lines = [compare("loss of each step, averaged over ranks", mean_loss, losses, show=False).line]
    for r in range(2):
        lines.append(
            compare(f"rank {r}'s parameters after {STEPS} steps", ranks[r]["params"], reference.params, show=False).line
        )
    return lines
