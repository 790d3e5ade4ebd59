"""Lab 05's graded prediction: the collective calls and payload bytes of one fp16, loss-scaled ZeRO-3 step, the
check zero3_traffic."""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches
from parlab.grading.labs import prediction_lines
from parlab.grading.labs.lab05_recording import _line, recording
from parlab.grading.labs.lab05_setup import LAUNCH, LR, B, buckets_of
from parlab.schemes.data_parallel import shard_batch

# The graded prediction: one step of ZeRO stage 3 as parlab.schemes.zero.stages runs it in fp16 (fp16 compute copy and
# gradients, fp32 master weights and Adam, a loss scale, no prefetch), on TRAFFIC_N ranks, for a GPT of 3 blocks (Psi =
# 42,784): lesson 05 prints no number of it (its stage-3 run is bf16, unscaled, on 4 ranks, for 2 blocks).
TRAFFIC_N = 2
TRAFFIC_CFG = GPTConfig(layers=3, dtype="float32")  # the fp32 master weights; the compute copy is fp16
LOSS_SCALE = 1024.0  # the first step does not overflow: nothing is skipped


def run_traffic() -> dict:
    """Rank code: one ZeRO-3 step of parlab.schemes.zero.stages in fp16 with a loss scale (fp32 master weights and
    Adam), this rank's rows, no prefetch; every collective this rank calls during the step: [op, payload bytes]."""
    from parlab.schemes.zero.stages import ZeRO

    P, r = dist.get_world_size(), dist.get_rank()
    model = build_model(TRAFFIC_CFG, seed=0)
    x, y = make_batches(TRAFFIC_CFG, B, 1, seed=0)[0]
    x_r, y_r = shard_batch(x, y, r, P)
    with recording() as seen:
        zero = ZeRO(model, 3, lr=LR, compute_dtype=torch.float16, loss_scale=LOSS_SCALE)  # no collective in here
        zero.scale(lm_loss(model(x_r), y_r)).backward()  # forward, then backward
        stepped = zero.step()  # Adam on the shard (False: the step overflowed and was skipped)
    zero.remove()
    return {"calls": seen.calls, "stepped": stepped}


def collect_zero3_traffic(calls_rank0, bytes_rank0) -> dict:
    measured = parlab.launch(run_traffic, TRAFFIC_N, **LAUNCH)[0]
    return {"calls_rank0": _plain(calls_rank0), "bytes_rank0": _plain(bytes_rank0), **measured}


def _plain(value):
    """A prediction as plain data for the grader (a number stays a number; anything else its text)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return value if isinstance(value, (int, float)) else repr(value)[:80]


def judge_zero3_traffic(data) -> list[str]:
    model = build_model(TRAFFIC_CFG)
    S = [
        -(-sum(p.numel() for p in unit) // TRAFFIC_N) for unit in buckets_of(model)
    ]  # parlab.schemes.zero.stages: a unit per layer
    fp16, fp32 = 2, 4
    # parlab.schemes.zero.stages's stage 3 (ZeRO._gather, ZeRO._reduce_ready_units, ZeRO.step), one unit per layer
    calls = 3 * len(S) + 1
    payload = sum(2 * fp16 * s + fp16 * TRAFFIC_N * s for s in S) + fp32
    return [
        *prediction_lines("collective calls of rank 0 in one step", data["calls_rank0"], calls, len(data["calls"]), 0),
        *prediction_lines(
            "payload bytes rank 0 hands to collectives in one step",
            data["bytes_rank0"],
            payload,
            sum(nbytes for _, nbytes in data["calls"]),
        ),
        _line("the measured step was not skipped (no fp16 overflow)", data["stepped"], True),
    ]
