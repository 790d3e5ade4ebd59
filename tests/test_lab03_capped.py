"""Lab 03's memory-capped part scores orders against a formula, the least bubble under a cap of k micro-batches per
rank: the formula must be reachable (else no answer passes) and no order may beat it (else the check would ask for
less than the best). Both are checked here: by search over every order for small pipelines, and by a constructive
order for the check's own cases and the prediction's."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from parlab.grading.labs import lab03_capped
from parlab.schemes.pipeline.actions import Action, Schedule
from parlab.schemes.pipeline.schedules import bubble, peak_inflight, validate

COST = {"F": 1, "B": 2}


def orders_of_one_rank(m: int, k: int) -> list[tuple]:
    """Every order of one rank's F0..F(m-1) and B0..B(m-1) (each kind in micro-batch order) holding at most k."""
    found = []

    def extend(f: int, b: int, order: tuple) -> None:
        if f == m and b == m:
            found.append(order)
        if f < m and f - b < k:
            extend(f + 1, b, (*order, ("F", f)))
        if b < f:
            extend(f, b + 1, (*order, ("B", b)))

    extend(0, 0, ())
    return found


def makespan(orders, p: int) -> int | None:
    """The ideal timeline's length (unit costs), or None when the orders deadlock; a small copy of simulate()."""
    position, free, done = [0] * p, [0] * p, {}
    while True:
        moved = False
        for r in range(p):
            while position[r] < len(orders[r]):
                op, mb = orders[r][position[r]]
                peer = r - 1 if op == "F" else r + 1
                before = done.get((op, mb, peer), 0) if 0 <= peer < p else 0
                if 0 <= peer < p and (op, mb, peer) not in done:
                    break
                start = max(free[r], before)
                done[(op, mb, r)] = free[r] = start + COST[op]
                position[r], moved = position[r] + 1, True
        if all(position[r] == len(orders[r]) for r in range(p)):
            return max(free)
        if not moved:
            return None


def least_makespan(p: int, m: int, k: int) -> Fraction:
    """(F + B)(p m / k + k - 1): the makespan of the formula the judge scores against."""
    return (1 - lab03_capped.least_bubble(p, m, k)) ** -1 * m * sum(COST.values())


@pytest.mark.parametrize("p, m, k", [(3, 4, 2), (4, 4, 2), (3, 6, 2), (2, 4, 1), (3, 3, 3)])
def test_no_order_under_the_cap_beats_the_formula_and_one_reaches_it(p, m, k):
    best = min(
        t for combo in itertools.product(orders_of_one_rank(m, k), repeat=p) if (t := makespan(combo, p)) is not None
    )
    assert best == least_makespan(p, m, k)


def greedy(p: int, m: int, k: int) -> list[list[tuple[str, int]]]:
    """One order that reaches the formula: actions placed in time, a backward first when both could start."""
    orders, free, ended = [[] for _ in range(p)], [0] * p, {}
    next_f, next_b = [0] * p, [0] * p
    for _ in range(2 * m * p):
        options = []
        for r in range(p):
            i, j = next_b[r], next_f[r]
            if i < j and (r == p - 1 or ("B", i, r + 1) in ended):
                options.append((max(free[r], ended.get(("B", i, r + 1), 0)), 0, r, "B", i))
            if j < m and j - i < k and (r == 0 or ("F", j, r - 1) in ended):
                options.append((max(free[r], ended.get(("F", j, r - 1), 0)), 1, r, "F", j))
        start, _, r, op, mb = min(options)
        ended[(op, mb, r)] = free[r] = start + COST[op]
        orders[r].append((op, mb))
        next_f[r] += op == "F"
        next_b[r] += op == "B"
    return orders


def test_the_check_cases_and_the_prediction_are_reachable():
    prediction = lab03_capped.CAPPED_PREDICTION
    for p, m, k in [*lab03_capped.CAPPED_CASES, (prediction["p"], prediction["m"], prediction["k"])]:
        schedule = Schedule("capped", p, m, 1, [[Action(op, mb) for op, mb in o] for o in greedy(p, m, k)])
        assert max(peak_inflight(schedule)) <= k
        assert bubble(validate(schedule), p) == lab03_capped.least_bubble(p, m, k), (p, m, k)
    assert lab03_capped.least_bubble(4, 8, 4) == Fraction(3, 11)  # k = p: 1F1B's (p-1)/(m+p-1)
