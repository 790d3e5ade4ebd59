"""Lab 06's checks: ZeRO-Offload's optimizer step on the host, serial then overlapped, and the device budget that
decides which units' optimizer state leaves the device, on live ranks (see parlab/grading).

The emulated rank (lab06_rank.py). On this machine the "device" and the "host" are the same RAM, as in lesson 06:
what makes a tensor device or host memory is which `Memory` allocated it, and what a place holds is counted from
its tensors. The link between them (PCIe on a real machine) is parlab.schemes.zero.offload's CopyEngine: one background
thread that runs the copies in the order they were issued, beside the rank's own work. Every call into the link and
every Adam call is logged in program order; the checks read what moved where, and when the rank waited, from that log.

The layout is ZeRO-2's (parlab/schemes/zero/stages.py): each unit (layer) u of the reference GPT is a flat buffer of N x
S_u numbers on the device (S_u = ceil(Psi_u / N), zero-padded), rank r owns slice r of every unit, and after backward
a reduce-scatter gives rank r the mean over ranks of its slice of each unit's gradient.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.distributed as dist

import parlab
from parlab.core.check import check_equal, compare
from parlab.core.models import GPT, build_model, lm_loss, make_batches
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.lab06_rank import (
    CFG,
    LR,
    Link,
    Memory,
    backward_and_reduce,
    gather_params,
    train_host_step,
    zero2_model,
)
from parlab.schemes.zero.offload import train_offload
from parlab.schemes.zero.stages import adam_step, plan_units
from parlab.schemes.zero.theory import offload_memory

LAUNCH = {"timeout": 60, "echo": False}  # a hang stops after 60 s
N, B, STEPS = 2, 8, 2  # ranks, global batch rows, steps (the GPT CFG and Adam's LR: lab06_rank.py)
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T] token ids
BYTES = 8  # float64: b_c = b_m = 8 in the runs of the code checks
BUDGET = 500_000  # bytes of device memory per rank for the measured run of the budget check

STRUCTURAL = {
    "serial": "2 ranks, 2 steps: every rank ends with one device's Adam; per rank the host holds exactly the "
    "gradient buffer, master, m and v of its shard; from the log, every unit of every step was stepped by Adam on "
    "host memory after its gradient copy was waited for, and its parameter slice copied back from the master after "
    "that Adam; init moved the shard once to the host, each step once each way; no copy left unwaited on return",
    "overlap": "as serial, and from the log's program order, every step: unit k+1's gradient copy issued before Adam "
    "on unit k and waited for after it; unit k's parameter copy still in flight when Adam on unit k+1 began",
    "offload_bytes": "parlab.schemes.zero.offload's own ZeRO-Offload run on 3 ranks (float32 compute, float64 "
    "master): rank 0's host and device bytes before the optimizer step and its copy engine's bytes per step, against "
    "theory",
    "budget": "at 6 configurations (this run, everything fits, only the parameters fit, one byte short, mixed "
    "precision at 1B and 10B parameters): the plan fits the budget and moves the fewest bytes any placement that "
    "fits allows, or raises ValueError when nothing fits; this run's plan on 2 ranks: the device and host bytes "
    "measured before the optimizer step and the bytes moved per step equal the plan's, the parameters one device's",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ------------------------------------------------------------------------------------------------ the judging


@functools.lru_cache(maxsize=1)  # the same reference for every check and every notebook graded
def _reference_params(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One device, the whole batch, Adam (parlab.schemes.zero.stages.adam_step: torch.optim.Adam's update, written out;
    tested against torch.optim.Adam in tests/test_zero.py)."""
    model = build_model(CFG, seed=0)
    moments = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in model.named_parameters()}
    for t, (x, y) in enumerate(BATCHES[:steps], start=1):
        model.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                adam_step(p, p.grad, *moments[name], t, LR)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _segments(log: list) -> tuple[list, list[list]]:
    """The log cut at its markers: (init's entries, [each step's entries]); each ends with its "returned"."""
    init, steps, current = [], [], None
    for entry in log:
        if entry["op"] == "init":
            current = init
        elif entry["op"] == "step":
            steps.append([])
            current = steps[-1]
        if current is not None and entry["op"] not in ("init", "step"):
            current.append(entry)
    return init, steps


def _covers(outer: list | None, inner: list) -> bool:
    """Does place `outer` ([name, allocation, a, b]) contain place `inner`?"""
    return outer is not None and outer[:2] == inner[:2] and outer[2] <= inner[2] and inner[3] <= outer[3]


def _analyse_step(entries: list, shards: list[int], r: int) -> dict:
    """What one step's log says, per unit k: its gradient copy to the host, the Adam call that stepped it (one
    call may step several units), its parameter copy back, and where each sits in program order."""
    U = len(shards)
    waits = {}
    for i, e in enumerate(entries):
        if e["op"] == "wait":
            waits.setdefault(e["copy"], i)
    downs = {
        k: [
            (i, e)
            for i, e in enumerate(entries)
            if e["op"] == "to_host" and e["src"] == ["device", U + k, 0, shards[k]]
        ]
        for k in range(U)
    }
    units = []
    for k in range(U):
        if len(downs[k]) != 1:
            units.append({"complete": False})
            continue
        di, de = downs[k][0]
        adams = [(i, e) for i, e in enumerate(entries) if e["op"] == "adam" and _covers(e["grad"], de["dst"])]
        if len(adams) != 1:
            units.append({"complete": False})
            continue
        ai, ae = adams[0]
        size = ae["grad"][3] - ae["grad"][2]
        on_host = all(
            ae[x] is not None and ae[x][0] == "host" and ae[x][3] - ae[x][2] == size for x in ("master", "m", "v")
        )
        distinct = on_host and len({tuple(ae[x][:3]) for x in ("master", "m", "v", "grad")}) == 4
        # unit k's piece of the master weights: where its gradient sits in the gradient Adam read
        mine = None
        if on_host:
            a = ae["master"][2] + de["dst"][2] - ae["grad"][2]
            mine = [*ae["master"][:2], a, a + shards[k]]
        slice_r = ["device", k, r * shards[k], (r + 1) * shards[k]]
        ups = [(i, e) for i, e in enumerate(entries) if e["op"] == "to_device" and e["dst"] == slice_r]
        if len(ups) != 1:
            units.append({"complete": False})
            continue
        ui, ue = ups[0]
        units.append(
            {
                "complete": True,
                "host_adam": distinct and ue["src"] == mine,
                "down": (di, waits.get(de["copy"], math.inf)),
                "adam": ai,
                "up": (ui, waits.get(ue["copy"], math.inf)),
            }
        )
    returned = next((e["pending"] for e in entries if e["op"] == "returned"), -1)
    moved = {op: sum(e["bytes"] for e in entries if e["op"] == op) for op in ("to_host", "to_device")}
    return {"units": units, "pending": returned, "moved": moved}


def _step_lines(res: dict, r: int, overlap: bool) -> list[str]:
    shards, S = res["shards"], sum(res["shards"])
    U = len(shards)
    init, steps = _segments(res["log"])
    analysed = [_analyse_step(entries, shards, r) for entries in steps]
    done = [u for a in analysed for u in a["units"] if u["complete"]]
    host_adam = sum(u["host_adam"] for u in done)
    pending = sum(a["pending"] for a in analysed) + sum(e["pending"] for e in init if e["op"] == "returned")
    down = sum(a["moved"]["to_host"] for a in analysed) / max(len(analysed), 1)
    up = sum(a["moved"]["to_device"] for a in analysed) / max(len(analysed), 1)
    init_down = sum(e["bytes"] for e in init if e["op"] == "to_host")
    in_order = sum(u["down"][1] < u["adam"] < u["up"][0] for u in done)
    every = U * len(steps)
    lines = [
        check_equal(
            f"rank {r}: units stepped by Adam on host memory (master, m, v) and copied back from the "
            "master, per step x steps",
            host_adam,
            every,
        ).line,
        check_equal(
            f"rank {r}: units whose gradient was waited for before their Adam, and whose parameter copy "
            "was issued after it",
            in_order,
            every,
        ).line,
        check_equal(
            f"rank {r}: bytes copied to the host by init_state (the master weights)", init_down, BYTES * S
        ).line,
        check_equal(f"rank {r}: bytes copied to the host per step (the gradient shard)", down, BYTES * S).line,
        check_equal(f"rank {r}: bytes copied to the device per step (the parameter slice)", up, BYTES * S).line,
        check_equal(f"rank {r}: copies not waited for when init_state or the step returned", pending, 0).line,
    ]
    if not overlap:
        return lines
    ahead, behind = 0, 0
    for a in analysed:
        us = a["units"]
        for k in range(U - 1):
            if us[k]["complete"] and us[k + 1]["complete"]:
                issued, waited = us[k + 1]["down"]
                ahead += issued < us[k]["adam"] < waited  # in flight during Adam on unit k
                issued, waited = us[k]["up"]
                behind += us[k]["adam"] < issued and waited > us[k + 1]["adam"]  # in flight when Adam k+1 began
    pairs = (U - 1) * len(analysed)
    lines += [
        check_equal(
            f"rank {r}: unit k+1's gradient copy in flight during Adam on unit k (issued before, waited for after)",
            ahead,
            pairs,
        ).line,
        check_equal(
            f"rank {r}: unit k's parameter copy still in flight when Adam on unit k+1 began", behind, pairs
        ).line,
    ]
    return lines


# ------------------------------------------------------------------------------------------------ the checks


def collect_serial(init_state, offload_step) -> dict:
    return {"ranks": list(parlab.launch(train_host_step, N, init_state, offload_step, BATCHES, **LAUNCH))}


def judge_serial(data) -> list[str]:
    return _judge_steps(data, overlap=False)


def collect_overlap(init_state, overlapped_step) -> dict:
    return {"ranks": list(parlab.launch(train_host_step, N, init_state, overlapped_step, BATCHES, **LAUNCH))}


def judge_overlap(data) -> list[str]:
    return _judge_steps(data, overlap=True)


def _judge_steps(data, overlap: bool) -> list[str]:
    ranks, reference = data["ranks"], _reference_params()
    lines = [compare(f"rank {r}: parameters after {STEPS} steps", ranks[r]["params"], reference).line for r in range(N)]
    for r in range(N):
        S = sum(ranks[r]["shards"])
        what = f"rank {r}: host bytes held (gradient buffer, master, m, v)"
        lines.append(check_equal(what, ranks[r]["host_bytes"], 4 * BYTES * S).line)
        lines += _step_lines(ranks[r], r, overlap)
    return lines


# ---- the prediction: parlab.schemes.zero.offload's own run (ZeRO-Offload, compute float32, master float64, 2 ranks)

PREDICT_N, PREDICT_B, PREDICT_STEPS = 3, 6, 2


def _library_offload(batches) -> dict:
    model = build_model(CFG, seed=0)  # float64: the master weights, m, v
    out = train_offload(model, batches, target="cpu", compute_dtype=torch.float32)
    return {"steady": out["steady"]}


def collect_offload_bytes(host_bytes, device_bytes, moved_bytes) -> dict:
    batches = make_batches(CFG, PREDICT_B, PREDICT_STEPS, seed=0)
    results = parlab.launch(_library_offload, PREDICT_N, batches, **LAUNCH)
    moved = sum(e.bytes for e in results.trace.events if e.rank == 0 and e.kind in ("offload", "upload"))
    steady = results[0]["steady"]
    return {
        "predicted": [host_bytes, device_bytes, moved_bytes],
        "host": sum(steady["host"].values()),
        "device": sum(steady["device"].values()),
        "moved": moved / PREDICT_STEPS,
    }


def judge_offload_bytes(data) -> list[str]:
    b_c, b_m = 4, 8  # float32 compute copy, float64 master, m, v
    numels = _gpt_numels()
    S = sum(-(-n // PREDICT_N) for n in numels)  # rank 0's shard: its padded slice of every unit
    host, device, moved = data["predicted"]
    lines = prediction_lines("host bytes of rank 0 before the optimizer step", host, 4 * b_m * S, data["host"])
    lines += prediction_lines(
        "device bytes of rank 0 before the optimizer step", device, b_c * PREDICT_N * S, data["device"]
    )
    lines += prediction_lines("bytes rank 0's copy engine moves per step", moved, 2 * b_c * S, data["moved"])
    return lines


# ---- the budget


def plan_bytes(numels: list[int], N: int, b_c: int, b_m: int, places: list[str]) -> dict[str, int]:
    """Bytes per rank of a placement: on the device, on the host, and moved per step (the judge's accounting)."""
    shards = [-(-n // N) for n in numels]
    device = b_c * N * sum(shards)  # every rank holds every unit's N slices of the compute copy
    host, moved = 0, 0
    for S_u, place in zip(shards, places, strict=True):
        if place == "device":
            device += 4 * b_m * S_u  # gradient shard, master, m, v
        else:
            host += 4 * b_m * S_u
            moved += 2 * b_c * S_u  # the gradient shard down, the parameter slice up
    return {"device": device, "host": host, "moved": moved}


def fewest_moved(numels: list[int], N: int, b_c: int, b_m: int, budget: int) -> int | None:
    """The fewest bytes per step any placement that fits the budget moves (None: none fits), by trying them all."""
    best = None
    for places in itertools.product(("device", "host"), repeat=len(numels)):
        need = plan_bytes(numels, N, b_c, b_m, list(places))
        if need["device"] <= budget and (best is None or need["moved"] < best):
            best = need["moved"]
    return best


def _gpt_numels() -> list[int]:
    """Psi_u of each unit of the reference GPT."""
    return [u.numel for u in plan_units(GPT(CFG), 1)]


def budget_configs() -> list[dict]:
    """(what, unit sizes Psi_u, N, b_c, b_m, device budget per rank) of the plans the check asks for."""
    gpt = _gpt_numels()
    S4 = sum(-(-n // 4) for n in gpt)
    return [
        {
            "what": f"this lab's run: the GPT on N=2, float64, budget {BUDGET:,} B",
            "numels": gpt,
            "N": 2,
            "b_c": 8,
            "b_m": 8,
            "budget": BUDGET,
        },
        {
            "what": "the GPT on N=4, b_c=4, b_m=8, everything fits exactly",
            "numels": gpt,
            "N": 4,
            "b_c": 4,
            "b_m": 8,
            "budget": 4 * 4 * S4 + 4 * 8 * S4,
        },
        {
            "what": "the GPT on N=4, b_c=4, b_m=8, only the parameters fit",
            "numels": gpt,
            "N": 4,
            "b_c": 4,
            "b_m": 8,
            "budget": 4 * 4 * S4,
        },
        {
            "what": "the GPT on N=4, b_c=4, b_m=8, one byte less than the parameters",
            "numels": gpt,
            "N": 4,
            "b_c": 4,
            "b_m": 8,
            "budget": 4 * 4 * S4 - 1,
        },
        {
            "what": "1B parameters in units of 400M, 300M, 300M on N=1, b_c=2, b_m=4, budget 11.6 GB",
            "numels": [400_000_000, 300_000_000, 300_000_000],
            "N": 1,
            "b_c": 2,
            "b_m": 4,
            "budget": 11_600_000_000,
        },
        {
            "what": "10B parameters in 10 units of 1B on N=4, b_c=2, b_m=4, a 32 GB device",
            "numels": [1_000_000_000] * 10,
            "N": 4,
            "b_c": 2,
            "b_m": 4,
            "budget": 32_000_000_000,
        },
    ]


def run_plan(places: list[str], batches) -> dict:
    """Rank code of the budget check: ZeRO-2 with each unit's optimizer state where `places` says. A unit on the
    device is stepped there; a unit on the host has its gradient shard copied over, is stepped on the host, and its
    parameter slice copied back. Returns the bytes each place held before the optimizer step, the bytes moved."""
    N, r = dist.get_world_size(), dist.get_rank()
    device, host, log = Memory("device"), Memory("host"), []
    model, units = zero2_model(device, N)
    link = Link(device, host, log)
    state = []
    try:
        for u, place in zip(units, places, strict=True):
            memory = device if place == "device" else host
            st = {name: memory.zeros(u.shard_numel) for name in ("master", "m", "v", "grad")}  # [S_u] each
            st["master"].copy_(u.shard_of(u.flat, r))  # the initial weights (a copy: not counted as a move)
            state.append(st)
        held, losses = [], []
        for t, (x, y) in enumerate(batches, start=1):
            shards = [device.zeros(u.shard_numel) for u in units]  # [S_u] each: the reduce-scatter outputs
            losses.append(backward_and_reduce(model, units, x, y, shards))
            start = len(log)
            for k, (st, g) in enumerate(zip(state, shards, strict=True)):
                if places[k] == "device":
                    st["grad"].copy_(g)
                else:
                    link.to_host(g, st["grad"]).wait()
                device.free(g)  # the reduce-scatter output is dropped once its gradient shard is in place
            held.append({"device": device.nbytes(), "host": host.nbytes()})
            for k, (u, st) in enumerate(zip(units, state, strict=True)):
                adam_step(st["master"], st["grad"], st["m"], st["v"], t, LR)
                mine = u.shard_of(u.flat, r)
                if places[k] == "device":
                    mine.copy_(st["master"])
                else:
                    link.to_device(st["master"], mine).wait()
            log.append({"op": "moved", "bytes": sum(e.get("bytes", 0) for e in log[start:])})
            gather_params(units)
    finally:
        link.close()
    moved = [e["bytes"] for e in log if e["op"] == "moved"]
    return {
        "held": held,
        "moved": moved,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def collect_budget(plan_offload) -> dict:
    plans = []
    for config in budget_configs():
        try:
            plan = plan_offload(config["numels"], config["N"], config["b_c"], config["b_m"], config["budget"])
            plans.append([str(place) for place in plan])
        except ValueError as error:
            plans.append(f"ValueError: {error}")
    run = None
    if isinstance(plans[0], list) and len(plans[0]) == len(budget_configs()[0]["numels"]):
        run = list(parlab.launch(run_plan, N, plans[0], BATCHES, **LAUNCH))
    return {"plans": plans, "ranks": run}


def judge_budget(data) -> list[str]:
    plans, lines = data["plans"], []
    for i, config in enumerate(budget_configs()):
        what, plan = config["what"], plans[i]
        args = (config["numels"], config["N"], config["b_c"], config["b_m"])
        best = fewest_moved(*args, config["budget"])
        if best is None:
            raised = isinstance(plan, str) and plan.startswith("ValueError")
            lines.append(f"{what}: nothing fits, the plan raises ValueError: {'PASS' if raised else 'FAIL'}")
            continue
        if isinstance(plan, str) or len(plan) != len(config["numels"]) or set(plan) - {"device", "host"}:
            lines.append(f"{what}: a place, 'device' or 'host', for each of the {len(config['numels'])} units: FAIL")
            continue
        need = plan_bytes(*args, plan)
        fits = need["device"] <= config["budget"]
        lines.append(
            f"{what}: device bytes per rank {need['device']:,} within the budget {config['budget']:,}: "
            f"{'PASS' if fits else 'FAIL'}"
        )
        fewest = need["moved"] == best
        lines.append(
            f"{what}: bytes moved per step {need['moved']:,}, the fewest any placement that fits moves "
            f"({best:,}): {'PASS' if fewest else 'FAIL'}"
        )
    ranks = data["ranks"]
    if ranks is None:
        return lines + ["measured run of this lab's plan: FAIL"]
    config = budget_configs()[0]
    need = plan_bytes(config["numels"], config["N"], config["b_c"], config["b_m"], plans[0])
    reference = _reference_params()
    for r, res in enumerate(ranks):
        lines += [
            compare(f"rank {r}: parameters after {STEPS} steps, your placement", res["params"], reference).line,
            check_equal(
                f"rank {r}: device bytes before the optimizer step, measured = your plan's",
                max(h["device"] for h in res["held"]),
                need["device"],
            ).line,
            check_equal(
                f"rank {r}: host bytes before the optimizer step, measured = your plan's",
                max(h["host"] for h in res["held"]),
                need["host"],
            ).line,
            check_equal(
                f"rank {r}: bytes moved per step, measured = your plan's", max(res["moved"]), need["moved"]
            ).line,
        ]
    return lines


def library_accounting_agrees() -> bool:
    """The judge's accounting at its two ends is the library's own (offload_memory, targets none and cpu):
    tests/test_labs.py checks it."""
    gpt = _gpt_numels()
    for n, b_c, b_m in [(2, 8, 8), (3, 4, 8)]:
        U = len(gpt)
        for target, place in [("none", "device"), ("cpu", "host")]:
            mine = plan_bytes(gpt, n, b_c, b_m, [place] * U)
            library = offload_memory(gpt, n, target, b_c, b_m)["steady_total"]
            if (mine["device"], mine["host"]) != (library["device"], library["host"]):
                return False
    return True
