"""Lab 05's checks: one rank's ZeRO stage-1 step (its optimizer-state shard, the reduce-scatter of the gradients,
Adam on its shard, the all-gather of the parameters), on live ranks (see parlab/grading)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import parlab
from parlab.check import check_equal, compare
from parlab.data_parallel import shard_batch
from parlab.grading import probe, run_check
from parlab.memory import tensor_bytes
from parlab.models import GPTConfig, build_model, lm_loss, make_batches, train_single_device

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
CFG = GPTConfig()  # the reference GPT: 2 layers, hidden 32, float64: Psi = 30,080 parameters
B, STEPS, LR = 8, 3, 1e-3  # global batch rows, training steps, Adam's learning rate
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T] token ids
K = 3 * 8  # bytes of optimizer state per parameter in float64: master weight, Adam m, Adam v

STRUCTURAL = {
    "state": "on 3 ranks (Psi = 30,080 is not divisible by 3: one padding number), each rank's master, m and v are "
    "[S] with S = ceil(Psi/3): the master its own slice of the flat parameters, m = v = 0; it holds K S bytes",
    "step": "one step on 4 ranks, each from the gradient of its own rows: every rank ends with one device's Adam "
    "step; at the process group, one reduce-scatter into an [S] shard and one all-gather of [N*S], no all-reduce",
    "training": "3 steps on 2 ranks: the losses and every parameter match one device with Adam; the optimizer "
    "states each rank holds are K Psi/N bytes",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def flat_model(N: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The reference GPT whose parameters and gradients are views of two flat buffers [N*S], S = ceil(Psi/N),
    zero-padded: flat_param (writing it writes the parameters) and flat_grad (backward accumulates into it)."""
    model = build_model(CFG, seed=0)  # the same weights on every rank
    psi = sum(p.numel() for p in model.parameters())
    S = math.ceil(psi / N)
    flat_param = torch.zeros(N * S, dtype=torch.float64)
    flat_grad = torch.zeros(N * S, dtype=torch.float64)
    offset = 0
    for p in model.parameters():
        n = p.numel()
        flat_param[offset : offset + n] = p.detach().reshape(-1)
        p.data = flat_param[offset : offset + n].view_as(p)
        p.grad = flat_grad[offset : offset + n].view_as(p)
        offset += n
    return model, flat_param, flat_grad


def train_zero1(init_state, zero_step, batches) -> dict:
    """Rank code: ZeRO stage 1 with your two functions. batches: the global batches, the same list on every rank."""
    N, r = dist.get_world_size(), dist.get_rank()
    model, flat_param, flat_grad = flat_model(N)
    state = init_state(flat_param)  # rank r's master weights, m, v: [S] each
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        flat_grad.zero_()
        x_r, y_r = shard_batch(x, y, r, N)  # [B/N, T]
        loss = lm_loss(model(x_r), y_r)  # the mean over this rank's rows
        loss.backward()  # flat_grad <- the gradient of this rank's rows [N*S]
        zero_step(flat_param, flat_grad, state, step)
        losses.append(loss.item())
    held = {"params": tensor_bytes(flat_param), "grads": tensor_bytes(flat_grad), "optimizer": tensor_bytes(state)}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": torch.tensor(losses, dtype=torch.float64), "params": params, "held": held}


# ------------------------------------------------------------------------------------------------ the checks


def _run_state(init_state) -> dict:
    _, flat_param, _ = flat_model(dist.get_world_size())
    state = init_state(flat_param)
    return {"state": dict(state), "flat": flat_param, "held": tensor_bytes(state)}


def collect_state(init_shard_state) -> dict:
    return {"ranks": list(parlab.launch(_run_state, 3, init_shard_state, **LAUNCH))}


def judge_state(data) -> list[str]:
    ranks, N = data["ranks"], 3
    S = len(ranks[0]["flat"]) // N
    lines = []
    for r, res in enumerate(ranks):
        state, mine = res["state"], res["flat"][r * S : (r + 1) * S]
        zeros = torch.zeros(S, dtype=torch.float64)
        what = f"rank {r}: master weights"
        master = compare(what, state["master"], mine, show=False, against=f"slice {r} of the flat parameters")
        moments = compare(f"rank {r}: m and v", [state["m"], state["v"]], [zeros, zeros], show=False, against="zeros")
        held = check_equal(f"rank {r}: optimizer bytes held (K x S, padding included)", res["held"], K * S, show=False)
        lines += [master.line, moments.line, held.line]
    return lines


def _run_step(init_state, zero_step, x, y) -> dict:
    N, r = dist.get_world_size(), dist.get_rank()
    model, flat_param, flat_grad = flat_model(N)
    x_r, y_r = shard_batch(x, y, r, N)
    lm_loss(model(x_r), y_r).backward()  # the gradient of this rank's rows, in the flat gradient
    state = init_state(flat_param)
    with probe.recording(keep_sent_data=False) as calls:
        zero_step(flat_param, flat_grad, state, 1)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "calls": calls}


def collect_step(init_shard_state, zero_step) -> dict:
    return {"ranks": list(parlab.launch(_run_step, 4, init_shard_state, zero_step, *BATCHES[0], **LAUNCH))}


def judge_step(data) -> list[str]:
    ranks, N = data["ranks"], 4
    reference = train_single_device(CFG, BATCHES[:1], seed=0, optimizer="adam", lr=LR).params
    psi = sum(t.numel() for t in reference.values())
    S = math.ceil(psi / N)
    lines = []
    for r, res in enumerate(ranks):
        lines.append(compare(f"rank {r}: parameters after one step", res["params"], reference, show=False).line)
    for r, res in enumerate(ranks):
        calls = res["calls"]
        scattered = probe.total_bytes(calls, "reduce_scatter_single")
        gathered = probe.total_bytes(calls, "all_gather_single")
        all_reduces = sum(c["op"] == "allreduce" for c in calls)
        lines += [
            check_equal(f"rank {r}: bytes reduce-scattered into its gradient shard", scattered, S * 8, show=False).line,
            check_equal(f"rank {r}: bytes of the all-gathered parameters", gathered, N * S * 8, show=False).line,
            check_equal(f"rank {r}: all-reduces", all_reduces, 0, show=False).line,
        ]
    return lines


def collect_training(init_shard_state, zero_step) -> dict:
    return {"ranks": list(parlab.launch(train_zero1, 2, init_shard_state, zero_step, BATCHES, **LAUNCH))}


def judge_training(data) -> list[str]:
    ranks, N = data["ranks"], 2
    reference = train_single_device(CFG, BATCHES, seed=0, optimizer="adam", lr=LR)
    mean_loss = torch.stack([res["losses"] for res in ranks]).mean(dim=0)  # each rank's loss is over B/N rows
    losses = torch.tensor(reference.losses, dtype=torch.float64)
    psi = sum(t.numel() for t in reference.params.values())
    lines = [compare("loss of each step, averaged over ranks", mean_loss, losses, show=False).line]
    for r in range(N):
        lines.append(
            compare(f"rank {r}'s parameters after {STEPS} steps", ranks[r]["params"], reference.params, show=False).line
        )
    for r in range(N):
        held = ranks[r]["held"]["optimizer"]
        lines.append(check_equal(f"rank {r}: optimizer bytes held = K Psi/N", held, K * psi // N, show=False).line)
    return lines
