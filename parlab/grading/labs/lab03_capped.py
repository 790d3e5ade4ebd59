"""Lab 03's memory-capped pipeline: a 1F1B-like order in which no rank ever holds more than k micro-batches'
activations, k < p allowed (1F1B's rank 0 holds p), and the prediction of its bubble (made before the orders are
built: nothing here prints the least bubble of an order the student gives).

The judge scores the student's orders against the least bubble any order under the cap reaches (unit costs F = 1,
B = 2, communication free, k <= p and k dividing m), a formula checked by search over every order for small p and m
(tests/test_lab03_capped.py); it builds no order of its own. At k = p the formula is 1F1B's (p-1)/(m+p-1).
"""

from __future__ import annotations

from fractions import Fraction

from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab03_setup import LIBRARY
from parlab.schemes.pipeline.actions import Action, Schedule
from parlab.schemes.pipeline.schedules import ScheduleError, bubble, peak_inflight, validate

# (p, m, k): k < p except (3, 6, 3), where the cap is 1F1B's own; k = 1 runs one micro-batch at a time.
CAPPED_CASES = [(4, 8, 2), (4, 6, 3), (5, 10, 2), (6, 12, 4), (3, 6, 3), (4, 4, 1)]
CAPPED_PREDICTION = {"p": 8, "m": 24, "k": 3}  # the predicted pipeline: no check case, more stages than any


def least_bubble(p: int, m: int, k: int) -> Fraction:
    """The least bubble of any order with at most k (<= p, dividing m) micro-batches held per rank (see above)."""
    if not (1 <= k <= p and m % k == 0):
        raise ValueError(f"the formula needs 1 <= k <= p and k dividing m: p={p}, m={m}, k={k}")
    return 1 - Fraction(m) / (Fraction(p * m, k) + k - 1)


def capped_theory() -> dict[str, float]:
    """THEORY of the prediction: the least bubble under the cap at CAPPED_PREDICTION."""
    return {"bubble": float(least_bubble(**CAPPED_PREDICTION))}


def _plain_orders(orders, p: int) -> list[list[list]]:
    """Every rank's order as plain data: [[op, micro-batch], ...] per rank (p lists)."""
    return [[[str(op), int(mb)] for op, mb in rank_order] for rank_order in list(orders)[: p + 1]]


def collect_capped(capped_orders) -> dict:

    out = {}
    with library_calls(LIBRARY) as called:
        for p, m, k in CAPPED_CASES:
            out[f"{p},{m},{k}"] = _plain_orders(capped_orders(p, m, k), p)
    return {"orders": out, "library": called}


def _schedule(orders, p: int, m: int) -> Schedule:
    if len(orders) != p:
        raise ScheduleError(f"{len(orders)} ranks' orders for p={p}")
    return Schedule("capped", p, m, 1, [[Action(str(op), int(mb)) for op, mb in order] for order in orders])


def judge_capped(data) -> list[str]:
    lines = [library_line("your capped orders", data.get("library", ["(calls not recorded)"]))]
    for p, m, k in CAPPED_CASES:
        case = f"p={p}, m={m}, k={k}"
        try:
            schedule = _schedule(data["orders"][f"{p},{m},{k}"], p, m)
            if any(a.op not in ("F", "B") for acts in schedule.actions for a in acts):
                raise ScheduleError("only F and B actions here (no BI, BW)")
            timeline = validate(schedule)  # the ideal timeline, unit costs F = 1, B = 2
        except (ScheduleError, ValueError, TypeError, KeyError, IndexError) as error:
            lines.append(f"{case}: {error}: FAIL")
            continue
        lines.append(f"{case}: every micro-batch forward and backward once, no deadlock, messages in order: PASS")
        peaks = peak_inflight(schedule)
        over = next((r for r in range(p) if peaks[r] > k), None)
        verdict = "PASS" if over is None else f"rank {over} holds {peaks[over]} at once: FAIL"
        lines.append(f"{case}: at most k = {k} micro-batches in flight on every rank: {verdict}")
        ideal, least = bubble(timeline, p), least_bubble(p, m, k)
        if ideal <= least:
            verdict = f"{ideal}, the least possible under the cap: PASS"
        else:  # the least is not shown here: it is the prediction's formula, at other sizes
            makespan = max(t.end for t in timeline)
            verdict = f"{ideal} (makespan {makespan}), more than the least possible under the cap: FAIL"
        lines.append(f"{case}: bubble of the ideal timeline {verdict}")
    return lines


# ------------------------------------------------------------------------------------------ the prediction


def collect_capped_bubble(predicted: dict) -> dict:
    value = predicted.get("bubble") if isinstance(predicted, dict) else None
    try:
        value = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        value = repr(value)[:40]
    return {"predicted": value}


def judge_capped_bubble(data) -> list[str]:
    from parlab.grading.labs import prediction_lines

    p, m, k = CAPPED_PREDICTION["p"], CAPPED_PREDICTION["m"], CAPPED_PREDICTION["k"]
    label = f"the least bubble with at most k = {k} in flight (p = {p}, m = {m})"
    return prediction_lines(label, data["predicted"], capped_theory()["bubble"], rtol=0.01)
