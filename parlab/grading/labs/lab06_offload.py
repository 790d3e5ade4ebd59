"""Lab 06's checks: ZeRO-Offload's optimizer step on the host for LAMB, whose trust ratio needs every tensor whole
while each rank holds a slice of it and the host holds no gradient, serial then overlapped with the link, the bytes
of a mixed placement, and the placement that fits a device budget moving the fewest bytes, on live ranks (see
parlab/grading/labs/).

The emulated rank (lab06_rank.py). As in lesson 06, the "device" and the "host" of a rank on this machine are the
same RAM: what makes a tensor device or host memory is which `Memory` allocated it, and what a place holds is
counted from its tensors. The link between them (PCIe on a real machine) is one background thread that runs the
copies in the order they were issued, beside the rank's own work. Every call into the link and every call of the
handed-out LAMB pieces (moments, update) is logged in program order, and the step's process-group calls are
recorded; the checks read what moved where, which buffer the moments read, which ratio each update used and when
the rank waited, from that log.

The model is the labs' own (parlab.core.lab_model, untied), with one unit per TENSOR (not per layer, as the
library's ZeRO cuts it): 21 units of four sizes (the embedding, the head and the SwiGLU matrices; q and o; GQA's
smaller k and v; the RMSNorm gains), so that no unit divides by N = 3 and every one is padded. The layout is
ZeRO-2's: unit u is a flat buffer of N x S_u numbers on the device (S_u = ceil(Psi_u / N), zero-padded), rank r owns
slice r of every unit, and after backward a reduce-scatter gives rank r the mean over ranks of its slice of each
unit's gradient. The optimizer is LAMB (You et al. 2019): Adam's direction u scaled per tensor by ||W|| / ||u||
over the WHOLE tensor, which no rank holds: the parts need the norms of every slice, summed over the ranks in one
all-reduce of at most two numbers per tensor. The host holds, per offloaded unit, the master weights, m and v, and
for the gradients only one staging area of a given size (pinned memory is scarce): no gradient outlives its
moments, which the serial and overlap checks verify exactly. The serial check gives the area the largest shard;
the overlap check gives it 1024 numbers, fewer than two of the largest shards (2 x 683), so that the gradient that
lands while another unit's moments read theirs fits beside it only for some pairs of units: the step must choose the
order of the moments (LAMB's ratios need them all before any update, in any order). The prediction asks for the
smallest area with which such an order exists for a placement: a bottleneck path over the units' sizes
(smallest_staging).
"""

from __future__ import annotations

import functools
import random

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm
from parlab.core.check import compare
from parlab.core.lab_model import build_lab_model, lab_batches, lab_loss
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab06_rank import (
    CFG,
    LIBRARY,
    LR,
    Link,
    Memory,
    backward_and_reduce,
    direction,
    gather_params,
    lamb_reference_step,
    moments_,
    train_host_step,
    trust_ratio,
    unit_numels,
    zero2_model,
)
from parlab.grading.labs.notebook_watch import NotebookWatch

LAUNCH = {"timeout": 60, "echo": False}  # a hang stops after 60 s
N, B, STEPS = 3, 6, 2  # ranks, global batch rows, steps (the lab model and LAMB's constants: lab06_rank.py)
BATCHES = lab_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T] token ids
BYTES = 8  # float64: b_c = b_m = 8 in the runs of the code checks
NORMS = 2  # numbers per tensor the step's one all-reduce may carry (LAMB needs ||W||^2 and ||u||^2 of each)
SERIAL_STAGING = max(-(-n // N) for n in unit_numels())  # the serial check's staging area: the largest shard, 683
OVERLAP_STAGING = 1024  # the overlap check's: fewer numbers than two of the largest shards, more than one
# The prediction: the lab model on N = 3 ranks, a float32 compute copy, float64 master, m, v, and this placement:
# units whose name has one of these keep their state on the device (GQA's k and v: what is left to separate the
# eight largest shards in the moments' order is the five RMSNorm gains and the four q, o matrices).
PREDICT = {"N": 3, "b_c": 4, "b_m": 8}
PREDICT_ON_DEVICE = (".attn.k.", ".attn.v.")
CODE = "parlab's offload or ZeRO code or this lab's checks"  # what LIBRARY holds, as the verdicts name it
BUDGET = 300_000  # bytes of device memory per rank for the measured run of the budget check (N = 3, float64)

STRUCTURAL = {
    "serial": "3 ranks, 2 LAMB steps of the lab model, one unit per tensor: every rank ends with one device's LAMB "
    "on whole tensors; every update's trust ratio equals its whole tensor's ||W|| / ||u|| (not its slice's); per "
    "step exactly one process-group call, an all-reduce of at most two numbers per tensor; the host holds exactly "
    "master, m, v of every unit and the staging area init_state was given (the largest shard: no gradient kept for "
    "later); from the log, every unit of every step: the moments ran on host memory, on the unit's m, v and the "
    "place its gradient was copied into, after that copy was waited for, with no other copy into that place in "
    "between; the update on its own master (the copy of its device slice), m and v, after its moments; its "
    "parameter slice copied back from the master after the update; init moved the shard once to the host, each "
    "step once each way; no copy left unwaited; no library code called. FAIL: the first rank, step and unit that "
    "differ, with expected and received",
    "overlap": "as serial with a staging area of 1024 numbers (fewer than two of the largest shards), and from the "
    "log's program order, every step: for every two units whose moments run one after the other, the second's "
    "gradient copy issued before the first's moments and waited for after them (with the rule that no copy lands "
    "on a gradient not yet read, the model's order cannot do it: the moments must be ordered); for every two units "
    "updated one after the other, the first's parameter copy still in flight when the second's update began",
    "offload_bytes": "the predicted smallest staging area, in bytes, with which the overlap check's schedule exists "
    "for a placement of the lab model that keeps GQA's k and v on the device (N=3, float64 state), and the host "
    "bytes of rank 0 with it, exactly against the judge's exhaustive search over the orders of the moments (a "
    "bottleneck path; two of the largest shards and the largest plus the smallest both fail) and against a run "
    "of that schedule on 3 ranks whose log is verified, measured; no library call from the notebook's cells",
    "budget": "at 9 configurations (this run: 21 tensors on N=3; 39 tensors of a 4-layer lab model; 40 units of "
    "distinct arbitrary sizes; everything fits exactly; only the parameters fit and one byte short, at N=2 and at "
    "N=3 where every unit is padded; Llama-3-8B's 35 layers on 8 ranks of 24 GB): the plan fits the budget and "
    "moves the fewest bytes any placement that fits allows (found by the judge over every reachable total, not "
    "greedily), or raises ValueError when nothing fits; this run's plan on 3 ranks: the device and host bytes "
    "measured before the optimizer step and the bytes moved per step equal the plan's, the parameters one "
    "device's; no library code called",
}

# The notebook's own cells (the prediction): the library's offload and its formulas. This module is left out: the
# check cells call into it (a PREDICT cell cannot: parlab.grading.markers refuses it).
WATCH = NotebookWatch([entry for entry in LIBRARY if not entry.startswith("grading/")])


def watch_notebook() -> None:
    """Setup cell: from now on, calls into LIBRARY from this notebook's cells are noted (and fail the prediction)."""
    WATCH.start()


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading.labs. The watch of the notebook's cells ends once the prediction is checked."""
    with WATCH.paused():
        run_check(__name__, check, *answers)
    if check in ("offload_bytes", "budget"):
        WATCH.stop()


# ------------------------------------------------------------------------------------------------ the judging


@functools.lru_cache(maxsize=1)  # the same reference for every check and every notebook graded
def _reference(steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """One device, the whole batch, LAMB on every whole tensor (lab06_rank.lamb_reference_step): the parameters
    after `steps` steps, and each step's trust ratio of each tensor {name: ratio}."""
    model = build_lab_model(CFG, seed=0)
    moments = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in model.named_parameters()}
    ratios = []
    for t, (x, y) in enumerate(BATCHES[:steps], start=1):
        model.zero_grad(set_to_none=True)
        lab_loss(model(x), y).backward()
        with torch.no_grad():
            ratios.append({n: lamb_reference_step(p, p.grad, *moments[n], t) for n, p in model.named_parameters()})
    return {n: p.detach().clone() for n, p in model.named_parameters()}, ratios


def host_layout_bytes(shards: list[int], staging: int, b_m: int = BYTES) -> int:
    """What the host holds when the units `shards` (S_u) are offloaded: master, m, v, and a staging area of
    `staging` numbers (none when nothing is offloaded)."""
    return b_m * (3 * sum(shards) + (staging if shards else 0))


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


def _overlaps(a: list | None, b: list | None) -> bool:
    """Do places a and b ([name, allocation, start, stop]) share an element?"""
    return a is not None and b is not None and a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3]


def _masters(init: list, shards: list[int], r: int) -> list:
    """Unit k's master weights: where init_state copied rank r's device slice of unit k (None: not exactly once)."""
    masters = []
    for k, S in enumerate(shards):
        copies = [e for e in init if e["op"] == "to_host" and e["src"] == ["device", k, r * S, (r + 1) * S]]
        masters.append(copies[0]["dst"] if len(copies) == 1 else None)
    return masters


def _placed(S: int, down: dict, moments: dict, update: dict, up: dict, master: list) -> str | None:
    """Why unit k's tensors are not where ZeRO-Offload keeps them (None: they are)."""
    places = [moments["grad"], moments["m"], moments["v"], update["master"]]
    if any(p is None or p[0] != "host" for p in [*places, update["m"], update["v"]]):
        return "the moments or the update read device memory (master, m, v and the gradient must be host memory)"
    if any(p[3] - p[2] != S for p in places):
        return f"the moments' or the update's tensors are not [S_u] = [{S}]"
    if any(_overlaps(a, b) for i, a in enumerate(places) for b in places[i + 1 :]):
        return "the master, m, v and the gradient share memory"
    if (moments["m"], moments["v"]) != (update["m"], update["v"]):
        return "the update read other m, v than the moments wrote"
    if moments["grad"] != down["dst"]:
        return f"the moments read {moments['grad']}, not the buffer its gradient was copied into ({down['dst']})"
    if up["src"] != master:
        return "its device slice was not copied back from its master"
    return None


def _analyse_step(entries: list, shards: list[int], masters: list, r: int, ratios: list[float]) -> dict:
    """What one step's log says, per unit k: where its moments and update ran and on what (`placed`), the order of
    its gradient copy, moments, update and parameter copy (`ordered`), whether another copy wrote into its gradient
    buffer before its moments read it (`clean`), whether its update used the whole tensor's trust ratio (`ratio`):
    each None when right, else the reason. Plus the order of the moments and the updates (for the overlap)."""
    U = len(shards)
    waited = {}
    for i, e in enumerate(entries):
        if e["op"] == "wait":
            waited.setdefault(e["copy"], i)
    waits = lambda e: waited.get(e["copy"], len(entries))  # noqa: E731
    units, by_moments, by_update = [], [], []
    for k, S in enumerate(shards):
        down = [(i, e) for i, e in enumerate(entries) if e["op"] == "to_host" and e["src"] == ["device", U + k, 0, S]]
        update = [(i, e) for i, e in enumerate(entries) if e["op"] == "update" and e["master"] == masters[k]]
        mine = ["device", k, r * S, (r + 1) * S]
        up = [(i, e) for i, e in enumerate(entries) if e["op"] == "to_device" and e["dst"] == mine]
        moments = []
        if masters[k] is not None and len(update) == 1:  # the unit's m: the one its update reads
            moments = [(i, e) for i, e in enumerate(entries) if e["op"] == "moments" and e["m"] == update[0][1]["m"]]
        unit = {"placed": None, "ordered": None, "clean": None, "ratio": None}
        if masters[k] is None:
            unit["placed"] = "no master weights: init_state did not copy its device slice to the host once"
        elif [len(down), len(moments), len(update), len(up)] != [1, 1, 1, 1]:
            unit["placed"] = (
                f"expected 1 gradient copy to the host, 1 moments on the m its update reads, 1 update on its master, "
                f"1 copy of its slice back; received {len(down)}, {len(moments)}, {len(update)}, {len(up)}"
            )
        if unit["placed"]:
            units.append({key: unit["placed"] for key in unit})
            continue
        (di, de), (mi, me), (ui, ue), (pi, pe) = down[0], moments[0], update[0], up[0]
        by_moments.append((mi, de, k))
        by_update.append((ui, pe, k))
        unit["placed"] = _placed(S, de, me, ue, pe, masters[k])
        if waits(de) > mi:
            unit["ordered"] = "its gradient copy was not waited for before its moments"
        elif ui < mi:
            unit["ordered"] = "its update ran before its moments"
        elif pi < ui:
            unit["ordered"] = "its parameter copy was issued before its update"
        others = [e for e in entries[di + 1 : mi] if e["op"] == "to_host" and _overlaps(e["dst"], de["dst"])]
        if others:
            unit["clean"] = f"another copy wrote into its gradient buffer {de['dst']} before its moments read it"
        if not abs(ue["ratio"] - ratios[k]) <= 1e-9 * abs(ratios[k]):  # (a NaN ratio is wrong too)
            unit["ratio"] = f"expected the whole tensor's {ratios[k]:.10g}, received {ue['ratio']:.10g}"
        units.append(unit)
    returned = next((e["pending"] for e in entries if e["op"] == "returned"), -1)
    moved = {op: sum(e["bytes"] for e in entries if e["op"] == op) for op in ("to_host", "to_device")}
    complete = len(by_moments) == U
    ahead = behind = None
    if complete:
        by_moments.sort(key=lambda item: item[0])
        by_update.sort(key=lambda item: item[0])
        position = {id(e): i for i, e in enumerate(entries)}
        for (a_at, _, a), (_, b_down, b) in zip(by_moments, by_moments[1:], strict=False):
            if ahead is None and not (position[id(b_down)] < a_at < waits(b_down)):
                ahead = (a, b)  # unit b's gradient copy was not in flight during unit a's moments
        for (_, a_up, a), (b_at, _, b) in zip(by_update, by_update[1:], strict=False):
            if behind is None and not (waits(a_up) > b_at):
                behind = (a, b)  # unit a's parameter copy was waited for before unit b's update began
    return {"units": units, "pending": returned, "moved": moved, "ahead": ahead, "behind": behind, "complete": complete}


def _first(ranks_steps: list, key: str, names: list[str]) -> str | None:
    """The first (rank, step, unit) whose `key` is wrong, as text, or None."""
    for r, steps in enumerate(ranks_steps):
        for s, step in enumerate(steps):
            for k, unit in enumerate(step["units"]):
                if unit[key]:
                    return f"rank {r}, step {s + 1}, unit {names[k]}: {unit[key]}"
    return None


def _verdict(what: str, wrong: str | None) -> str:
    return f"{what}: PASS" if wrong is None else f"{what}: {wrong}: FAIL"


def _collectives_wrong(ranks: list, units: int) -> str | None:
    """The first rank and step whose step did not make exactly one all-reduce of at most NORMS numbers per tensor."""
    for r, res in enumerate(ranks):
        for s, calls in enumerate(res["collectives"]):
            ops = [c["op"] for c in calls]
            if len(ops) != 1 or ops[0] not in ("allreduce", "allreduce_coalesced"):  # one call, one or more tensors
                shown = ", ".join(ops[:4]) + (f" (+{len(ops) - 4} more)" if len(ops) > 4 else "")
                return f"rank {r}, step {s + 1}: expected one allreduce, received {len(ops)} calls ({shown or 'none'})"
            if calls[0]["bytes"] > NORMS * units * BYTES:
                numbers = calls[0]["bytes"] // BYTES
                return f"rank {r}, step {s + 1}: the allreduce carried {numbers:,} float64 numbers for {units} tensors"
    return None


def _judge_steps(data, overlap: bool, staging: int) -> list[str]:
    ranks = data["ranks"]
    reference, ratios = _reference()
    lines = [compare(f"rank {r}: parameters after {STEPS} steps", ranks[r]["params"], reference).line for r in range(N)]
    shards, names = ranks[0]["shards"], ranks[0]["names"]
    U, S, host = len(shards), sum(shards), host_layout_bytes(shards, staging)
    analysed, init_bytes, pending = [], [], []
    for r, res in enumerate(ranks):
        init, steps = _segments(res["log"])
        masters = _masters(init, shards, r)
        expected = [[ratios[s][name] for name in names] for s in range(len(steps))]
        analysed.append([_analyse_step(entries, shards, masters, r, expected[s]) for s, entries in enumerate(steps)])
        init_bytes.append(sum(e["bytes"] for e in init if e["op"] == "to_host"))
        pending.append(
            sum(a["pending"] for a in analysed[-1]) + sum(e["pending"] for e in init if e["op"] == "returned")
        )
    every = "every rank, step and unit"
    lines.append(
        _verdict(
            f"{every}: the update's trust ratio is the whole tensor's ||W|| / ||u||", _first(analysed, "ratio", names)
        )
    )
    what = f"every rank and step: one process-group call, an all-reduce of at most {NORMS} numbers per tensor"
    lines.append(_verdict(what, _collectives_wrong(ranks, U)))
    held = [res["host_bytes"] for res in ranks]
    wrong = next((f"rank {r}: expected {host:,}, received {h:,}" for r, h in enumerate(held) if h != host), None)
    what = f"every rank: host bytes held, {host:,}: master, m, v of every unit and a staging area of {staging:,}"
    lines.append(_verdict(f"{what} numbers", wrong))
    for key, what in [
        (
            "placed",
            "the moments on host memory, on the unit's m, v and the buffer its gradient was copied into; the update "
            "on the unit's master (its device slice's copy), m, v; the device slice copied back from the master",
        ),
        (
            "ordered",
            "the gradient copy waited for before the moments, the update after them, the parameter copy after it",
        ),
        ("clean", "no other copy into the unit's gradient buffer between its copy and its moments"),
    ]:
        lines.append(_verdict(f"{every}: {what}", _first(analysed, key, names)))
    wrong = None
    for r, steps in enumerate(analysed):
        if init_bytes[r] != BYTES * S:
            wrong = f"rank {r}: init_state moved {init_bytes[r]:,} to the host, expected {BYTES * S:,}"
        for s, step in enumerate(steps):
            down, up = step["moved"]["to_host"], step["moved"]["to_device"]
            if wrong is None and (down, up) != (BYTES * S, BYTES * S):
                wrong = f"rank {r}, step {s + 1}: moved {down:,} to the host and {up:,} to the device"
        if wrong:
            break
    what = f"every rank: bytes over the link, {BYTES * S:,} to the host by init_state, then each step"
    lines.append(_verdict(f"{what} {BYTES * S:,} each way", wrong))
    wrong = next((f"rank {r}: {n} left" for r, n in enumerate(pending) if n != 0), None)
    lines.append(_verdict("every rank: no copy left unwaited when init_state or the step returned", wrong))
    if overlap:
        for key, what in [
            (
                "ahead",
                "for every two units whose moments run one after the other, the second's gradient copy in flight "
                "during the first's moments (issued before, waited for after)",
            ),
            (
                "behind",
                "for every two units updated one after the other, the first's parameter copy still in flight "
                "when the second's update began",
            ),
        ]:
            wrong = None
            for r, steps in enumerate(analysed):
                for s, step in enumerate(steps):
                    if wrong is not None:
                        break
                    if not step["complete"]:
                        wrong = f"rank {r}, step {s + 1}: not every unit was stepped as in serial"
                    elif step[key] is not None:
                        a, b = step[key]
                        wrong = f"rank {r}, step {s + 1}: not for {names[a]} then {names[b]}"
            lines.append(_verdict(f"every rank and step: {what}", wrong))
    called = [name for res in ranks for name in res["library"]]
    lines.append(library_line("init_state and the step", called, CODE))
    return lines


# ------------------------------------------------------------------------------------------------ the checks


def collect_serial(init_state, offload_step) -> dict:
    ranks = parlab.launch(train_host_step, N, init_state, offload_step, BATCHES, SERIAL_STAGING, **LAUNCH)
    return {"ranks": list(ranks)}


def judge_serial(data) -> list[str]:
    return _judge_steps(data, overlap=False, staging=SERIAL_STAGING)


def collect_overlap(init_state, overlapped_step) -> dict:
    ranks = parlab.launch(train_host_step, N, init_state, overlapped_step, BATCHES, OVERLAP_STAGING, **LAUNCH)
    return {"ranks": list(ranks)}


def judge_overlap(data) -> list[str]:
    return _judge_steps(data, overlap=True, staging=OVERLAP_STAGING)


# ---- placements: what a rank holds and moves


def plan_bytes(numels: list[int], N: int, b_c: int, b_m: int, places: list[str]) -> dict[str, int]:
    """Bytes per rank of a placement: on the device and on the host before the optimizer step, and moved per step
    (the judge's accounting: the compute copy b_c N S on the device; a unit kept there also its gradient shard,
    master, m, v, 4 b_m S_u; an offloaded unit master, m, v on the host, 3 b_m S_u, its gradient through a staging
    area of the largest offloaded shard (the serial step's), and 2 b_c S_u over the link)."""
    shards = [-(-n // N) for n in numels]
    device = b_c * N * sum(shards)
    kept = sum(S for S, place in zip(shards, places, strict=True) if place == "device")
    offloaded = [S for S, place in zip(shards, places, strict=True) if place == "host"]
    return {
        "device": device + 4 * b_m * kept,
        "host": host_layout_bytes(offloaded, max(offloaded, default=0), b_m),
        "moved": 2 * b_c * sum(offloaded),
    }


def fewest_moved(numels: list[int], N: int, b_c: int, b_m: int, budget: int) -> int | None:
    """The fewest bytes per step any placement that fits the budget moves (None: none fits). Moving fewest = keeping
    the most numbers on the device, so: the largest total of kept shards within the room left by the parameters,
    over every total a subset of the units reaches. The totals are the bits of one integer when the room is at most
    10^7 numbers (any sizes), else a set (few totals: Llama's units repeat)."""
    shards = [-(-n // N) for n in numels]
    room = budget - b_c * N * sum(shards)
    if room < 0:
        return None
    cap = room // (4 * b_m)  # the most numbers whose gradient, master, m, v fit in the room
    if cap <= 10**7:
        reachable, mask = 1, (1 << (cap + 1)) - 1  # bit t set: some subset of the units totals t
        for S in shards:
            reachable |= (reachable << S) & mask
        return 2 * b_c * (sum(shards) - (reachable.bit_length() - 1))
    totals = {0}
    for S in shards:
        totals |= {total + S for total in totals if total + S <= cap}
    return 2 * b_c * (sum(shards) - max(totals))


def library_accounting_agrees() -> bool:
    """The judge's accounting at its two ends is the library's own (offload_memory, targets none and cpu) for the
    device; on the host the library keeps a full gradient shard (b_m S) where this lab keeps one staging area of
    the largest shard: the rest (master, m, v) agrees. tests/test_labs.py checks it."""
    from parlab.schemes.zero.theory import offload_memory

    numels = unit_numels()
    for n, b_c, b_m in [(2, 8, 8), (3, 4, 8)]:
        shards = [-(-x // n) for x in numels]
        for target, place in [("none", "device"), ("cpu", "host")]:
            mine = plan_bytes(numels, n, b_c, b_m, [place] * len(numels))
            library = offload_memory(numels, n, target, b_c, b_m)["steady_total"]
            staging = b_m * max(shards) if place == "host" else 0
            library_host = library["host"] - (b_m * sum(shards) if place == "host" else 0)
            if (mine["device"], mine["host"] - staging) != (library["device"], library_host):
                return False
    return True


def smallest_staging(shards: list[int]) -> tuple[int, list[int]]:
    """The smallest staging area (numbers) with which the overlap check's schedule exists for these offloaded
    shards, and an order of the moments that achieves it (indices into shards).

    While unit a's moments read its gradient, the next unit b's gradient is in flight into the same area, and no
    copy may land on a gradient not yet read: a and b occupy disjoint places, S_a + S_b <= P. Any order whose
    neighbours all fit works (the gradients alternate between the area's two ends), so P is the smallest
    bottleneck of a path through every unit: searched exactly over the orders of the distinct sizes (with their
    counts: the lab model has four), for each candidate P (the largest shard, and every sum of two) in turn."""
    sizes = sorted(set(shards))
    counts = tuple(shards.count(size) for size in sizes)

    def path(P: int) -> tuple | None:
        @functools.cache
        def rest(left: tuple, last: int) -> tuple | None:  # the sizes' indices of a path through `left`, or None
            if not any(left):
                return ()
            for i, count in enumerate(left):
                if count and (last < 0 or sizes[last] + sizes[i] <= P):
                    tail = rest(left[:i] + (count - 1,) + left[i + 1 :], i)
                    if tail is not None:
                        return (i, *tail)
            return None

        return rest(counts, -1)

    pairs = {a + b for i, a in enumerate(sizes) for j, b in enumerate(sizes) if i < j or (i == j and counts[i] > 1)}
    for P in sorted({max(shards)} | {p for p in pairs if p >= max(shards)}):
        found = path(P)
        if found is not None:
            by_size = {size: [k for k, S in enumerate(shards) if S == size] for size in sizes}
            return P, [by_size[sizes[i]].pop(0) for i in found]
    raise AssertionError("unreachable: P = twice the largest shard always works")


def run_plan(places: list[str], batches, compute: torch.dtype = torch.float64, order: list[int] | None = None) -> dict:
    """Rank code of the budget check and of the prediction's measurement: ZeRO-2 of the lab model with LAMB and each
    unit's optimizer state where `places` says. A unit on the device is stepped there; an offloaded unit has its
    gradient shard copied into the host's one staging area, its moments taken on the host, and, once one
    all-reduce has summed every tensor's ||W||^2 and ||u||^2 over the ranks, its update on the host and its slice
    copied back. Without `order`, serially, through an area of the largest offloaded shard; with `order` (the
    offloaded units' indices, smallest_staging's), overlapped as the overlap check asks, through the smallest area
    for that order: the next unit's gradient lands at the other end of the area while this unit's moments run.
    Returns the bytes each place held before the optimizer step, the staging area's bytes, the bytes moved per
    step, the parameters."""
    N, r = dist.get_world_size(), dist.get_rank()
    device, host, log = Memory("device"), Memory("host"), []
    model, units = zero2_model(device, N, compute)
    link = Link(device, host, log)
    offloaded = [k for k, place in enumerate(places) if place == "host"]
    size = lambda k: units[k].shard_numel  # noqa: E731
    ahead = order is not None  # overlapped: the next gradient in flight during each moments
    if not ahead:
        order, P = offloaded, max((size(k) for k in offloaded), default=0)
    else:
        P = max([size(k) for k in order] + [size(a) + size(b) for a, b in zip(order, order[1:], strict=False)])
    area = host.zeros(P) if offloaded else None  # [P]: the one staging area

    def place(i: int) -> torch.Tensor:  # [S_u] of the i-th offloaded unit: the area's two ends in turn, or its front
        S = size(order[i])
        return area[P - S :] if ahead and i % 2 else area[:S]

    state = []
    try:
        for u, where in zip(units, places, strict=True):
            memory = device if where == "device" else host
            names = ("master", "m", "v", "grad") if where == "device" else ("master", "m", "v")
            st = {name: memory.zeros(u.shard_numel) for name in names}  # [S_u] each, float64
            st["master"].copy_(u.shard_of(u.flat, r))  # the initial weights (a copy: not counted as a move)
            state.append(st)
        held, moved = [], []
        for t, (x, y) in enumerate(batches, start=1):
            shards = [device.zeros(u.shard_numel, compute) for u in units]  # [S_u]: the reduce-scatter outputs
            backward_and_reduce(model, units, x, y, shards)
            start = len(log)
            for k, where in enumerate(places):
                if where == "device":
                    state[k]["grad"].copy_(shards[k])
            in_transit = sum(g.numel() * g.element_size() for g in shards)  # the reduce-scatter outputs
            held.append({"device": device.nbytes() - in_transit, "host": host.nbytes()})
            squares = torch.zeros(len(units), 2, dtype=torch.float64, device=parlab.device())  # [U, 2] this rank's

            def moments(k: int, grad: torch.Tensor, squares: torch.Tensor = squares, t: int = t) -> None:
                st = state[k]
                moments_(grad, st["m"], st["v"])
                squares[k, 0] = st["master"].square().sum()  # ||W_r||^2 of this rank's slice
                squares[k, 1] = direction(st["m"], st["v"], t).square().sum()  # ||u_r||^2

            for k, where in enumerate(places):
                if where == "device":
                    moments(k, state[k]["grad"])
            down = None
            for i, k in enumerate(order):
                down = down or link.to_host(shards[k], place(i))
                down.wait()  # unit k's gradient is in the area
                down = None
                if ahead and i + 1 < len(order):  # the next one lands at the other end while unit k's moments run
                    down = link.to_host(shards[order[i + 1]], place(i + 1))
                moments(k, place(i))
            comm.all_reduce(squares)  # [U, 2]: every tensor's ||W||^2 and ||u||^2, summed over the ranks
            ups = []
            for k, (u, st) in enumerate(zip(units, state, strict=True)):
                ratio = trust_ratio(squares[k, 0].sqrt(), squares[k, 1].sqrt())
                st["master"].sub_(LR * ratio * direction(st["m"], st["v"], t))
                mine = u.shard_of(u.flat, r)
                if places[k] == "device":
                    mine.copy_(st["master"])
                else:
                    ups.append(link.to_device(st["master"], mine))
            for up in ups:
                up.wait()
            moved.append(sum(e.get("bytes", 0) for e in log[start:]))  # copies (waits carry no bytes)
            for g in shards:
                device.free(g)  # the reduce-scatter outputs are dropped once their gradients are in place
            gather_params(units)
    finally:
        link.close()
    return {
        "held": held,
        "staging": 0 if area is None else area.numel() * area.element_size(),
        "moved": moved,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


# ---- the prediction: the smallest staging area for the overlap, a mixed placement of the lab model's tensors


def predict_places() -> list[str]:
    names = [name for name, _ in build_lab_model(CFG).named_parameters()]
    return ["device" if any(part in name for part in PREDICT_ON_DEVICE) else "host" for name in names]


def _predict_schedule() -> tuple[int, list[int], list[int]]:
    """(the smallest area P in numbers, the order of the moments that reaches it as unit indices, the offloaded S_u)."""
    offloaded = [k for k, place in enumerate(predict_places()) if place == "host"]
    shards = [-(-unit_numels()[k] // PREDICT["N"]) for k in offloaded]
    P, order = smallest_staging(shards)
    return P, [offloaded[i] for i in order], shards


def offload_bytes_theory() -> dict[str, float]:
    P, _, shards = _predict_schedule()
    b_m = PREDICT["b_m"]
    return {"staging_bytes": b_m * P, "host_bytes": host_layout_bytes(shards, P, b_m)}


THEORY = {"offload_bytes": offload_bytes_theory}  # what the prediction's judge scores against


def _number(value):
    """A prediction as plain data for the grader: a float if it is a number, else its repr (which FAILs)."""
    if isinstance(value, bool):
        return repr(value)
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_offload_bytes(staging_bytes, host_bytes) -> dict:
    batches = lab_batches(CFG, B, 1, seed=1)  # one step: the bytes only
    _, order, _ = _predict_schedule()
    results = parlab.launch(run_plan, PREDICT["N"], predict_places(), batches, torch.float32, order, **LAUNCH)
    rank0 = results[0]
    return {
        "predicted": [_number(staging_bytes), _number(host_bytes)],
        "measured": [rank0["staging"], rank0["held"][0]["host"]],
        "library": list(WATCH.calls),
    }


def judge_offload_bytes(data) -> list[str]:
    theory = offload_bytes_theory()
    labels = {
        "staging_bytes": "the smallest staging area (bytes) with which the overlap exists",
        "host_bytes": "host bytes of rank 0 before the optimizer step, with that area",
    }
    lines = []
    for (name, label), predicted, measured in zip(labels.items(), data["predicted"], data["measured"], strict=True):
        lines += prediction_lines(label, predicted, theory[name], measured, rtol=0)
    lines.append(library_line("the prediction's cell", data["library"], "parlab's offload or ZeRO code"))
    return lines


# ---- the budget


def _llama3_8b_units() -> list[int]:
    """Llama-3-8B's parameters per layer unit: the embedding, 32 blocks (q, o 4096 x 4096; GQA's k, v 1024 x 4096;
    SwiGLU 3 x 14336 x 4096; two norms), the final norm, the untied head (128,256 x 4096)."""
    block = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096
    return [128_256 * 4096] + [block] * 32 + [4096, 128_256 * 4096]


def budget_configs() -> list[dict]:
    """(what, unit sizes Psi_u, N, b_c, b_m, device budget per rank) of the plans the check asks for."""
    from parlab.core.lab_model import LabConfig

    lab, deep = unit_numels(), unit_numels(LabConfig(layers=4))
    everything = plan_bytes(lab, 2, 4, 8, ["device"] * len(lab))["device"]
    params = plan_bytes(lab, 2, 4, 8, ["host"] * len(lab))["device"]
    padded = plan_bytes(lab, 3, 4, 8, ["host"] * len(lab))["device"]  # N = 3: every unit padded to 3 S_u
    distinct = sorted(random.Random(6).sample(range(1_000, 20_000), 40))  # 40 arbitrary sizes, none repeated
    distinct_budget = plan_bytes(distinct, 3, 4, 8, ["host"] * 40)["device"] + 4 * 8 * 2 * sum(distinct) // 15

    def config(what: str, numels: list[int], N: int, b_c: int, b_m: int, budget: int) -> dict:
        return {"what": what, "numels": numels, "N": N, "b_c": b_c, "b_m": b_m, "budget": budget}

    return [
        config(
            f"this lab's run: the lab model's 21 tensors on N=3, float64, budget {BUDGET:,} B", lab, 3, 8, 8, BUDGET
        ),
        config("a 4-layer lab model's 39 tensors on N=3, b_c=4, b_m=8, budget 400,000 B", deep, 3, 4, 8, 400_000),
        config(
            f"40 units of distinct arbitrary sizes on N=3, b_c=4, b_m=8, budget {distinct_budget:,} B",
            distinct,
            3,
            4,
            8,
            distinct_budget,
        ),
        config("the lab model on N=2, b_c=4, b_m=8, everything fits exactly", lab, 2, 4, 8, everything),
        config("the lab model on N=2, b_c=4, b_m=8, only the parameters fit", lab, 2, 4, 8, params),
        config("the lab model on N=2, b_c=4, b_m=8, one byte less than the parameters", lab, 2, 4, 8, params - 1),
        config("the lab model on N=3, b_c=4, b_m=8, only the parameters fit", lab, 3, 4, 8, padded),
        config("the lab model on N=3, b_c=4, b_m=8, one byte less than the parameters", lab, 3, 4, 8, padded - 1),
        config(
            "Llama-3-8B in 35 layer units on N=8, b_c=2, b_m=4, a 24 GB device",
            _llama3_8b_units(),
            8,
            2,
            4,
            24_000_000_000,
        ),
    ]


def collect_budget(plan_offload) -> dict:
    plans, configs = [], budget_configs()
    with library_calls(LIBRARY) as called:  # only the student's function inside: this module is in LIBRARY
        for config in configs:
            try:
                plan = plan_offload(config["numels"], config["N"], config["b_c"], config["b_m"], config["budget"])
                plans.append([str(place) for place in plan])
            except ValueError as error:
                plans.append(f"ValueError: {error}")
    run = None
    if isinstance(plans[0], list) and len(plans[0]) == len(configs[0]["numels"]):
        run = list(parlab.launch(run_plan, N, plans[0], BATCHES, **LAUNCH))
    return {"plans": plans, "ranks": run, "library": called}


def judge_budget(data) -> list[str]:
    plans, lines = data["plans"], []
    for i, config in enumerate(budget_configs()):
        what, plan = config["what"], plans[i]
        args = (config["numels"], config["N"], config["b_c"], config["b_m"])
        best = fewest_moved(*args, config["budget"])
        if best is None:
            raised = isinstance(plan, str) and plan.startswith("ValueError")
            received = "" if raised else f": received {plan if isinstance(plan, str) else 'a plan'}"
            lines.append(f"{what}: nothing fits, the plan raises ValueError{received}: {'PASS' if raised else 'FAIL'}")
            continue
        if isinstance(plan, str) or len(plan) != len(config["numels"]) or set(plan) - {"device", "host"}:
            received = plan if isinstance(plan, str) else f"{len(plan)} places {sorted(set(plan))[:3]}"
            units = len(config["numels"])
            lines.append(
                f"{what}: a place, 'device' or 'host', for each of the {units} units: received {received}: FAIL"
            )
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
    lines.append(library_line("plan_offload", data["library"], CODE))
    ranks = data["ranks"]
    if ranks is None:
        return lines + ["measured run of this lab's plan: no plan to run: FAIL"]
    config = budget_configs()[0]
    need = plan_bytes(config["numels"], config["N"], config["b_c"], config["b_m"], plans[0])
    reference = _reference()[0]
    for r, res in enumerate(ranks):
        lines.append(
            compare(f"rank {r}: parameters after {STEPS} steps, your placement", res["params"], reference).line
        )
    measured = {
        "device": [max(h["device"] for h in res["held"]) for res in ranks],
        "host": [max(h["host"] for h in res["held"]) for res in ranks],
        "moved": [max(res["moved"]) for res in ranks],
    }
    for key, what in [
        ("device", "device bytes before the optimizer step"),
        ("host", "host bytes before the optimizer step"),
        ("moved", "bytes moved per step"),
    ]:
        wrong = next(
            (
                f"rank {r}: expected {need[key]:,}, received {m:,}"
                for r, m in enumerate(measured[key])
                if m != need[key]
            ),
            None,
        )
        lines.append(_verdict(f"every rank: {what}, measured = your plan's ({need[key]:,})", wrong))
    return lines
