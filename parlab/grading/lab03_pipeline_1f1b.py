"""Lab 03's checks: the student's 1F1B order, checked as data, then run on 4 live ranks (see parlab/grading)."""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.distributed as dist

import parlab
from parlab.check import check_equal, compare
from parlab.grading import run_check
from parlab.models import GPTConfig, build_model, make_batches, train_single_device
from parlab.pipeline import (
    Action,
    Schedule,
    ScheduleError,
    Stage,
    bubble,
    peak_inflight,
    run_step,
    split_layers,
    validate,
)

LAUNCH = {"timeout": 60, "echo": False}
ORDER_CASES = [(4, 8), (2, 5)]  # (p, m)
CFG, BATCH = GPTConfig(layers=4), 8  # float64; one block per stage on 4 ranks
RUN_P, RUN_M = 4, 8

STRUCTURAL = {
    "order": "the order itself, simulated by the grader: every micro-batch forward and backward once, no deadlock, "
    "messages in order, the bubble of (p-1)/(m+p-1), at most p - r micro-batches in flight on rank r",
    "run": "that order on 4 live ranks: the step's loss and gradients match one device, and each rank's measured "
    "peak of micro-batches in flight is p - r",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def as_schedule(actions_of, p: int, m: int) -> Schedule:
    """Your function's actions for every rank, as the Schedule that parlab.pipeline checks and runs."""
    return Schedule("yours", p, m, 1, [[Action(op, mb) for op, mb in actions_of(r, p, m)] for r in range(p)])


def _orders(actions_of, p: int, m: int) -> list[list[list]]:
    """Every rank's actions as plain data: [[op, micro-batch], ...] per rank."""
    return [[[str(op), int(mb)] for op, mb in actions_of(r, p, m)] for r in range(p)]


def _from_orders(orders, p: int, m: int) -> Schedule:
    if len(orders) != p:
        raise ScheduleError(f"{len(orders)} ranks' orders for p={p}")
    actions = [[Action(str(op), int(mb)) for op, mb in rank_orders] for rank_orders in orders]
    return Schedule("yours", p, m, 1, actions)


def run_schedule(actions_of, p: int, m: int) -> dict:
    """Rank code: one training step of the 4-layer GPT in your order, this rank running stage r."""
    r = dist.get_rank()
    schedule = as_schedule(actions_of, p, m)
    stage = Stage(build_model(CFG, seed=0), r, p, split_layers(CFG.layers, p)[r])  # rank r keeps stage r only
    grad_group = dist.new_group(list(range(p)))  # gradients travel on a channel of their own, as in parlab.pipeline
    x, y = make_batches(CFG, BATCH, 1, seed=0)[0]  # the global batch [BATCH, T]
    stats = run_step(schedule, {0: stage}, CFG, x, y, 0, grad_group)
    grads = {name: w.grad for name, w in stage.named.items()}
    return {
        "grads": grads,
        "peak": int(stats.peak_inflight),
        "loss": float(stats.loss),
        "order": _orders(actions_of, p, m)[r],
    }


# ------------------------------------------------------------------------------------------------ the checks


def collect_order(one_f_one_b_actions) -> dict:
    return {"orders": {f"{p},{m}": _orders(one_f_one_b_actions, p, m) for p, m in ORDER_CASES}}


def judge_order(data) -> list[str]:
    lines = []
    for p, m in ORDER_CASES:
        try:
            schedule = _from_orders(data["orders"][f"{p},{m}"], p, m)
            timeline = validate(schedule)  # the ideal timeline, unit costs F = 1, B = 2
        except (ScheduleError, ValueError, TypeError, KeyError, IndexError) as error:
            lines.append(f"p={p}, m={m}: {error}: FAIL")
            continue
        lines.append(f"p={p}, m={m}: every micro-batch forward and backward once, no deadlock, messages in order: PASS")
        ideal, formula = bubble(timeline, p), Fraction(p - 1, m + p - 1)
        verdict = "PASS" if ideal == formula else "FAIL"
        lines.append(f"p={p}, m={m}: bubble of the ideal timeline {ideal} vs (p-1)/(m+p-1) = {formula}: {verdict}")
        peaks = peak_inflight(schedule)  # counted from the order: F adds a micro-batch's activations, B frees them
        verdict = "PASS" if peaks == [min(p - r, m) for r in range(p)] else "FAIL"
        lines.append(f"p={p}, m={m}: most micro-batches in flight on ranks 0..{p - 1}: {peaks} vs p - r: {verdict}")
    return lines


def collect_run(one_f_one_b_actions) -> dict:
    validate(as_schedule(one_f_one_b_actions, RUN_P, RUN_M))  # a schedule that would deadlock stops here
    return {"ranks": list(parlab.launch(run_schedule, RUN_P, one_f_one_b_actions, RUN_P, RUN_M, **LAUNCH))}


def judge_run(data) -> list[str]:
    ranks, p, m = data["ranks"], RUN_P, RUN_M
    lines = []
    try:  # the order the ranks ran must itself be a valid schedule (the loss and gradients do not show it)
        validate(_from_orders([res["order"] for res in ranks], p, m))
        lines.append(f"p={p}, m={m}: the order the ranks ran is a valid schedule: PASS")
    except (ScheduleError, ValueError, TypeError, KeyError, IndexError) as error:
        lines.append(f"p={p}, m={m}: the order the ranks ran: {error}: FAIL")
    reference = train_single_device(CFG, make_batches(CFG, BATCH, 1, seed=0), seed=0)
    loss = torch.tensor(float(ranks[p - 1]["loss"]), dtype=torch.float64)  # the last stage computes the loss
    lines.append(
        compare("loss of the step", loss, torch.tensor(reference.losses[0], dtype=torch.float64), show=False).line
    )
    grads = {name: g for res in ranks for name, g in res["grads"].items()}  # every stage's parameters
    lines.append(compare("gradients of every parameter, over all stages", grads, reference.grads, show=False).line)
    for r in range(p):
        peak = ranks[r]["peak"]
        lines.append(
            check_equal(f"rank {r}: micro-batches held at once, at most", peak, min(p - r, m), show=False).line
        )
    return lines
