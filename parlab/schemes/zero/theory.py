"""ZeRO's formulas (Rajbhandari et al., 2020): memory per device by stage and bytes on the wire per step; and
ZeRO-Offload's bytes per rank by place (device, host, disk).

Their one home: parlab/schemes/zero/stages.py (the algorithm) re-exports them, and the planner
(parlab/schemes/hybrid/planner.py) uses them for every ZeRO stage of a plan. Plain Python, no torch, so that `python -m
parlab plan` answers at once.
"""

from __future__ import annotations

OFFLOAD_TARGETS = ("none", "cpu", "disk")  # where offload keeps Adam's state (parlab/schemes/zero/offload.py)
K_MIXED = 12  # fp32 master weight + Adam m + Adam v: 4 + 4 + 4 bytes per parameter (the paper's K)


def zero_memory(psi: float, N: int, K: float = K_MIXED, param_bytes: float = 2, grad_bytes: float = 2) -> dict:
    """The paper's memory per device, by stage (bytes): params, grads and optimizer states, and their total.

    The paper's example, 7.5B parameters on N = 64 ranks: 120, 31.4, 16.6 and 1.9 GB for DP and stages 1-3."""
    full = {"params": param_bytes * psi, "grads": grad_bytes * psi, "optimizer": K * psi}
    sharded = {k: v / N for k, v in full.items()}
    keep = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}
    table = {}
    for stage, parts in keep.items():
        row = {k: (sharded if k in parts else full)[k] for k in full}
        table[stage] = {**row, "total": sum(row.values())}
    return table


def zero_comm_theory(psi: int, N: int, elem_bytes: int, stage: int) -> dict:
    """Per rank per step, ring algorithms: what DP's all-reduce puts on the wire, and what this stage does. The
    ratio, (1 + gathers) / 2, holds for any N >= 2 (on one rank nothing crosses a wire, in either)."""
    all_reduce = 2 * (N - 1) / N * psi * elem_bytes
    gathers = 2 if stage == 3 else 1
    zero_wire = (N - 1) / N * psi * elem_bytes * (1 + gathers)  # one reduce-scatter + the all-gathers
    return {
        "dp_all_reduce_wire_bytes": all_reduce,
        "theory_wire_bytes": zero_wire,
        "theory_ratio": (1 + gathers) / 2,  # zero_wire / all_reduce
    }


# --------------------------------------------------------------------------------------- ZeRO-Offload (offload.py)


def offload_memory(unit_numels: list[int], N: int, target: str, b_c: int, b_m: int) -> dict:
    """Bytes per rank by place (the table of parlab/schemes/zero/offload.py's docstring), from the units' sizes Psi_u.

    steady: what a rank holds before the optimizer step. peak: the most at any moment, with
      - the gradient buckets: the largest unit just flattened (its .grad, its flat copy [N*S_u], its shard [S_u])
        while the next largest is still reduce-scattering (its flat copy and shard);
      - disk: the read-ahead buffers, at most three units' master, m, v (the one being stepped, the one read
        ahead, the one being written back): a bound.
    """
    if target not in OFFLOAD_TARGETS:
        raise ValueError(f"target={target!r} must be one of {OFFLOAD_TARGETS}")
    shards = [-(-n // N) for n in unit_numels]  # S_u = ceil(Psi_u / N)
    S = sum(shards)
    params, grads, optimizer = b_c * N * S, b_m * S, 3 * b_m * S
    (n_a, s_a), (n_b, s_b) = (sorted(zip(unit_numels, shards, strict=True), reverse=True) + [(0, 0)])[:2]
    buckets = b_c * (n_a + N * s_a + s_a) + b_c * (N * s_b + s_b)  # unit a flattened while unit b is in flight
    read_ahead = 3 * b_m * sum(sorted(shards, reverse=True)[:3])
    if target == "none":
        steady = {"device": {"params": params, "grads": grads, "optimizer": optimizer}, "host": {}, "disk": {}}
    elif target == "cpu":
        steady = {"device": {"params": params}, "host": {"grads": grads, "optimizer": optimizer}, "disk": {}}
    else:
        steady = {"device": {"params": params}, "host": {"grads": grads}, "disk": {"optimizer": optimizer}}
    peak = {place: dict(parts) for place, parts in steady.items()}
    peak["device"]["grad buckets"] = buckets
    if target == "disk":
        peak["host"]["read-ahead"] = read_ahead
    total = lambda table: {place: sum(parts.values()) for place, parts in table.items()}  # noqa: E731
    return {"steady": steady, "peak": peak, "steady_total": total(steady), "peak_total": total(peak), "S": S}


def check_budget(need: dict[str, int], budget: dict[str, int], target: str) -> None:
    """A clear ValueError, before any process starts, when a place's budget (bytes per rank; 0: no limit) is
    smaller than what the run needs there (need: the peak bytes per rank by place)."""
    short = [place for place, limit in budget.items() if limit and need.get(place, 0) > limit]
    if short:
        lines = [f"{p}: needs {need[p]:,} bytes per rank, budget {budget[p]:,}" for p in short]
        where = ", ".join(f"{p} {n:,}" for p, n in need.items())
        raise ValueError(
            f"the memory budget is too small for target {target!r}: "
            + "; ".join(lines)
            + f" (the run needs, per rank: {where} bytes)"
        )
