"""Lab 11's checks: surviving dead machines without changing the training, the tensor-parallel layout of the lab
model, and the reshard of a ZeRO checkpoint of the lab model into that layout on another number of ranks, on live
ranks (see parlab/grading).

    part 1  survive          relaunch as machines keep dying, on as many of those left as can share the global batch
                             (18 rows) equally, each rank in as few micro-batches as its memory (2 rows) allows, from
                             the last checkpoint: the lessons' GPT, ZeRO-1, Adam, equal to one device on every row
    part 2  tp_layout        the box of every lab-model tensor each of M tensor-parallel ranks holds, and whether it
                             writes it: attention cut by query heads, each rank with the K/V heads its queries read
                             (GQA: replicated when M exceeds the K/V heads), row-parallel matrices cut by columns;
                             every element written by exactly one rank
    part 3  reshard          a ZeRO checkpoint of the lab model written by 3 ranks, loaded into those boxes on M = 2
                             and 4 ranks, reading each element of the box once, nothing else, in the fewest reads
    predict checkpoint_cost  the bytes the busiest rank writes for a tensor-parallel checkpoint (M = 4) when the
                             writers of the shared boxes are chosen at best, the best interval and the time lost
                             with asynchronous checkpoints

parlab's own fault-tolerance code (`LIBRARY`: the checkpoints, the failures, their runs and lesson helpers, and its
tensor-parallel layout) must not be called: the student's code runs under parlab/grading/labs/guard.py's hook, the
check's own callbacks (the launch, the reads) outside it. What a reshard read is recorded through the `read`
function it is given; what the loading ranks hold is compared with the checkpoint's tensors and with one device.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

import parlab
from parlab.core import comm
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model, lab_batches, lab_loss, train_lab_single_device
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches, make_optimizer, train_single_device
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.schemes.faults import checkpoint as ckpt
from parlab.schemes.faults.failures import FaultPlan, die
from parlab.schemes.zero.stages import ZeRO

LAUNCH = {"timeout": 60, "echo": False}
# Part 1: the lessons' small GPT (float64, Psi = 7,744), ZeRO-1 with Adam, 6 steps of a global batch of 18 rows,
# on a job of 4 machines; a rank holds at most 2 rows at once (a micro-batch of at most 2 rows).
CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float64")
MACHINES, B, ROWS_AT_ONCE, STEPS, LR = 4, 18, 2, 6, 1e-3
EVERY = 2  # a checkpoint after every 2 completed steps
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T]
# Parts 2-4: the lab model (parlab.core.lab_model's defaults: V = 64, H = 32, 4 query heads and 2 K/V heads of 8,
# F = 64, 2 blocks, untied, float64). Its ZeRO checkpoint is written by 3 ranks (no ZeRO unit of it divides by 3)
# after SAVED_AT Adam steps of 6 rows.
LAB = LabConfig()
SAVED_BY, SAVED_AT, LAB_B = 3, 3, 6
LAB_BATCHES = lab_batches(LAB, LAB_B, SAVED_AT, seed=0)
TP_WORLDS = (2, 4)  # the reshard's M: 4 exceeds the 2 K/V heads, each of which two ranks then hold
# tp_layout's cases: (query heads, K/V heads, M) of a one-block lab model with H = 32 (V = F = 64): GQA with its K/V
# heads split and replicated, multi-head (nkv = nq) and multi-query (nkv = 1) attention.
LAYOUT_CASES = [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 2, 8), (8, 4, 2), (8, 8, 4), (4, 1, 4)]
# the prediction's cluster: devices, each failing every DEVICE_MTBF_HOURS; a checkpoint pauses training PAUSE_S,
# then is written in the background for WRITE_S (it is complete PAUSE_S + WRITE_S after its pause began); a restart
# takes RESTART_S. Its checkpoint: the lab model on COST_M ranks.
DEVICE_MTBF_HOURS, DEVICES, PAUSE_S, WRITE_S, RESTART_S = 50_000, 4096, 6, 120, 300
COST_M = 4
ADAM = ("exp_avg", "exp_avg_sq")  # the checkpoint's names of Adam's m and v: optim.<parameter>.exp_avg, ...

# parlab's own code for what the parts ask (parlab/grading/labs/guard.py): checkpoints, failures, their runs and
# lesson helpers, and the tensor-parallel layout of the lessons' GPT.
LIBRARY = ("schemes/faults/", "runs/checkpoint.py", "lessons/fault_tolerance.py", "schemes/tensor_parallel.py")

STRUCTURAL = {
    "survive": "4 machines, ZeRO-1 with Adam, 18 rows a step, at most 2 rows a micro-batch; a machine dies in each of "
    "the first two launches (each a RankError, the second in step 6 of the relaunch): your launches, in order, must "
    "be 3 ranks x 6 rows in 3 micro-batches (18 does not split over 4), again 3 x 6 in 3 once a machine is lost (the "
    "fourth stands in), then 2 x 9 in 9 (9 rows in equal micro-batches of at most 2), each relaunch resuming from "
    "the step-4 checkpoint (not from scratch); a launch the harness refuses (more ranks than machines alive, more "
    "rows than the batch, unequal or oversized micro-batches) reaches your code as a ValueError and must reach the "
    "caller; the final parameters equal one device trained on all 18 rows of every step (a run on fewer rows, as "
    "parlab's own restart makes when the batch does not split, fails); a launch that fails before any rank "
    "starts is not retried, its error reaches the caller; no call into parlab's fault-tolerance code",
    "tp_layout": "for the lab model's every tensor on M tensor-parallel ranks (GQA with K/V heads split, replicated "
    "when M exceeds them, multi-head and multi-query attention; M = 1 to 8): each rank's box (rows, columns) equals "
    "Megatron's cut by query heads, K/V heads, F and vocabulary rows, and of the ranks holding the same box exactly "
    "one writes it (any one); the first wrong box or writer shown with expected and received; no call into "
    "parlab's code",
    "reshard": "a ZeRO checkpoint of the lab model written by 3 ranks, loaded into each rank's tensor-parallel box "
    "on M = 2 and 4 ranks: every rank's part of every tensor (weights, Adam m and v) equals the checkpoint's "
    "exactly, with the box's shape; the elements your code read (each read a range of one saved piece) are exactly "
    "the box's, each once (a read of a range that spans the gaps between a column box's rows fails, as does "
    "reading whole pieces); no more reads than the box's contiguous runs within each piece (reading a row box "
    "row by row fails); the weights put back together equal one device after the same steps; no call into "
    "parlab's checkpoint code",
    "checkpoint_cost": "the bytes the busiest rank writes for a tensor-parallel checkpoint of the lab model on 4 "
    "ranks (weights, Adam m and v, every element once) when each box several ranks hold is written by the holder "
    "that keeps the busiest rank lightest (exact; measured from a real save with that choice), the best interval "
    "and the time lost with asynchronous checkpoints and restarts (within 0.2%), against the prediction (THEORY)",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def single_device(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The lessons' GPT on one device: every step on all B rows (the run that never failed)."""
    return train_single_device(CFG, BATCHES[:steps], 0, "adam", LR).params


def _shape(x) -> list[int] | str:
    return list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


@contextmanager
def outside_the_guard():
    """The check's own code called back by the student's (the launch, a read): not the student's calls, so the
    guard's hook is off inside (in this thread and in threads started here)."""
    previous, threads = sys.getprofile(), threading.getprofile()
    sys.setprofile(None)
    threading.setprofile(None)
    try:
        yield
    finally:
        sys.setprofile(previous)
        threading.setprofile(threads)


def _library_line(what: str, called: list[str]) -> str:
    named = [c for c in called if "<" not in c] or called  # a function's inner comprehensions are not named beside it
    return library_line(what, named, "parlab's fault-tolerance code")


# ---- survive: catch the failure, relaunch on the survivors, the same global batch


# Who dies in which started launch: (rank, 1-based step). Each relaunch resumes from step 4: the second launch loses
# a rank in step 6, after which no newer checkpoint exists (none is taken after the last step).
DEATHS = {1: (2, 5), 2: (1, 6)}
# The launches of the best answer: (ranks, resume, rows per rank, micro-batches per step).
EXPECTED_LAUNCHES = [(3, False, 6, 3), (3, True, 6, 3), (2, True, 9, 9)]
MAX_LAUNCHES = 8  # a survive() that relaunches more often than this is stopped by the check (it would never end)


class TooManyLaunches(BaseException):
    """The check stops a survive() that keeps relaunching (a BaseException: `except Exception` does not catch it)."""


def elastic_rank(plan: FaultPlan, rows: int, micro_batches: int) -> dict:
    """Rank code of the check's launch_run: ZeRO-1 with Adam on the lessons' GPT. Rank r takes rows [r rows,
    (r+1) rows) of every global batch [B, T], in `micro_batches` equal micro-batches whose gradients it accumulates
    (each scaled by 1/micro_batches, so that the step averages over all P * rows rows); a checkpoint after every
    EVERY steps (parlab's sharded writer); resumed from the newest complete one; plan.kill_rank dies in the middle
    of step plan.at_step. Returns the step it started from and the final parameters (whole)."""
    rank = comm.group_rank()
    # ZeRO-1: each .grad a view of its unit's flat gradient, so the micro-batches' backwards add up in place, and the
    # step reduce-scatters the sum once
    zero = ZeRO(build_model(CFG, 0).to(parlab.device()), 1, lr=LR)
    start, size = 0, rows // micro_batches
    folder = ckpt.latest(plan.root) if plan.resume else None
    if folder is not None:  # rank r of P reads the ranges of its own shard (a reshard from the saving world size)
        reader = ckpt.Reader(folder)
        ckpt.load_zero(reader, zero)
        start = reader.step
    for k in range(start, STEPS):  # step k+1
        x, y = BATCHES[k]  # [B, T]
        zero.zero_grad()
        for j in range(micro_batches):
            lo = rank * rows + j * size  # rank r's j-th micro-batch: rows [lo, lo + size)
            x_j, y_j = x[lo : lo + size].to(parlab.device()), y[lo : lo + size].to(parlab.device())  # [size, T]
            loss = lm_loss(zero.model(x_j), y_j) / micro_batches
            if rank == plan.kill_rank and k + 1 == plan.at_step:
                die(rank, k + 1, plan.root)  # mid-step: the others wait for this rank's gradients in vain
            loss.backward()
        zero.step(k)  # / P: the mean over the P * rows rows
        if (k + 1) % EVERY == 0 and k + 1 < STEPS:
            ckpt.save(plan.root, k + 1, ckpt.zero_pieces(zero), layout="zero-1", extra={"optimizer_step": zero.t})
    params = zero.full_params()
    zero.remove()
    return {"start": start, "params": params}


def refusal(world_size, rows, micro_batches, alive: int) -> str:
    """Why the harness refuses a launch before any rank starts ('' when it does not)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (world_size, rows, micro_batches)):
        return f"world_size, rows and micro_batches must be positive ints: {world_size!r}, {rows!r}, {micro_batches!r}"
    if world_size > alive:
        return f"{world_size} ranks, but only {alive} machines are alive"
    if world_size * rows > B:
        return f"{world_size} ranks x {rows} rows = {world_size * rows} rows, but a global batch has {B}"
    if rows % micro_batches:
        return f"{rows} rows do not cut into {micro_batches} equal micro-batches"
    if rows // micro_batches > ROWS_AT_ONCE:
        return f"a micro-batch of {rows // micro_batches} rows does not fit a rank's memory ({ROWS_AT_ONCE} rows)"
    return ""


def _count(calls: list, world_size, resume, rows, micro_batches) -> None:
    calls.append([_plain(world_size), bool(resume), _plain(rows), _plain(micro_batches)])
    if len(calls) > MAX_LAUNCHES:
        raise TooManyLaunches(f"stopped by the check after {MAX_LAUNCHES} launches")


def collect_survive(survive) -> dict:
    root, calls, started, died, refused = tempfile.mkdtemp(prefix="parlab-lab11-"), [], [], [], []

    def launch_run(world_size, resume, rows, micro_batches):
        """Train on `world_size` ranks, each taking `rows` rows of every global batch in `micro_batches` equal
        micro-batches (resume: from the newest complete checkpoint). A machine dies in each of the first two
        launches that start (DEATHS). Returns the ranks' results (each: "params", "start")."""
        _count(calls, world_size, resume, rows, micro_batches)
        why = refusal(world_size, rows, micro_batches, MACHINES - len(died))
        if why:
            refused.append(why)
            raise ValueError(f"launch refused: {why}")
        started.append(len(started) + 1)
        kill_rank, at_step = DEATHS.get(started[-1], (None, 0))
        with outside_the_guard():
            plan = FaultPlan(root, every=EVERY, kill_rank=kill_rank, at_step=at_step, resume=bool(resume))
            try:
                return parlab.launch(elastic_rank, world_size, plan, rows, micro_batches, **LAUNCH)
            except parlab.RankError:
                died.append(started[-1])  # one machine fewer
                raise

    called = []
    try:
        try:
            with library_calls(LIBRARY) as called:
                results = survive(launch_run, MACHINES, B, ROWS_AT_ONCE)
            data = {"calls": calls, "world": len(results), "start": results[0]["start"], "params": results[0]["params"]}
        except (Exception, TooManyLaunches) as exc:  # a death or a refusal let through to the caller, or no end
            if isinstance(exc, parlab.RankError):
                why = f"a RankError reached the caller (rank {exc.rank} died)"
            elif isinstance(exc, ValueError) and refused and str(exc) == f"launch refused: {refused[-1]}":
                why = f"the harness refused a launch ({refused[-1]}) and the error reached the caller"
            else:
                why = f"{type(exc).__name__}: {str(exc)[:160]}"
            data = {"calls": calls, "world": 0, "start": None, "params": None, "unfinished": why}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    data["refused"] = refused
    data["other_error"] = _other_error(survive, called)
    data["library"] = list(called)
    return data


def _other_error(survive, called: list[str]) -> dict:
    """survive() once more, with a launch that fails before any rank starts, as parlab.launch does on a bad argument:
    no rank died, so there is nothing to relaunch; the error must reach the caller. Starts nothing."""
    calls, more = [], []

    def launch_run(world_size, resume, rows, micro_batches):
        _count(calls, world_size, resume, rows, micro_batches)
        raise ValueError("the check's own error: a bad argument, found before any rank started")

    try:
        with library_calls(LIBRARY) as more:
            survive(launch_run, MACHINES, B, ROWS_AT_ONCE)
        raised = "nothing"
    except Exception as exc:
        raised = type(exc).__name__
    except TooManyLaunches as exc:
        raised = f"nothing ({exc})"
    finally:
        called += [c for c in more if c not in called]
    return {"calls": calls, "raised": raised}


def _launch_said(call) -> str:
    if call is None:
        return "no launch"
    world, resume, rows, micro = call
    return f"{world} ranks x {rows} rows in {micro} micro-batches{', resuming' if resume else ', from step 0'}"


def judge_survive(data) -> list[str]:
    calls = [tuple(c) for c in data["calls"]]
    lines = [_library_line("survive", data["library"])]
    what = "launches (ranks x rows each in micro-batches, resume?), in order"
    if calls == EXPECTED_LAUNCHES:
        lines.append(f"{what}: {' | '.join(_launch_said(c) for c in calls)}: PASS")
    else:
        k = 0  # the first launch that differs
        while k < min(len(calls), len(EXPECTED_LAUNCHES)) and calls[k] == EXPECTED_LAUNCHES[k]:
            k += 1
        want = EXPECTED_LAUNCHES[k] if k < len(EXPECTED_LAUNCHES) else None
        got = calls[k] if k < len(calls) else None
        lines.append(f"{what}: launch {k + 1}: expected {_launch_said(want)}; received {_launch_said(got)}: FAIL")
    if data.get("unfinished"):
        lines.append(f"{data['unfinished']}; the job was not finished: FAIL")
    else:
        world, start = data["world"], data["start"]
        ended = "the run ended on 2 ranks, the most that can share the batch once 2 machines have died"
        lines.append(f"{ended}: PASS" if world == 2 else f"{ended}: received {world}: FAIL")
        lines.append(f"resumed from step {start} (the last checkpoint: 4): {'PASS' if start == 4 else 'FAIL'}")
        lines.append(
            compare(
                f"final parameters vs one device on all {B} rows of every step", data["params"], single_device()
            ).line
        )
    other = data["other_error"]
    ok = len(other["calls"]) == 1 and other["raised"] == "ValueError"
    lines.append(
        f"a launch that fails before any rank starts (ValueError, no rank died): {len(other['calls'])} launch(es), "
        f"the caller got {other['raised']} (expected: 1 launch, ValueError): {'PASS' if ok else 'FAIL'}"
    )
    return lines


# ---- tp_layout: the lab model's tensor-parallel layout, GQA included


def layout_config(heads: int, kv_heads: int) -> LabConfig:
    """tp_layout's models: one block of the lab model with H = 32, V = F = 64 and the given attention heads."""
    return LabConfig(hidden=32, heads=heads, kv_heads=kv_heads, layers=1)


def tp_box(name: str, shape: list[int], cfg: LabConfig, M: int, r: int) -> tuple[tuple, bool]:
    """The judge's own layout: rank r of M's box of the lab-model tensor `name` ((start, stop) per dimension) and
    whether r writes it in the checks' own checkpoints (the first rank holding that box; the student may choose
    any one of the holders).

    Megatron's cut: column-parallel matrices (q, k, v, gate, up; the embedding and the LM head by vocabulary rows)
    split their rows, row-parallel ones (o, down) their columns; attention by query heads, r holding query heads
    [r nq/M, (r+1) nq/M) and the K/V heads they read; RMSNorm gains whole on every rank."""
    if len(shape) == 1:
        return ((0, shape[0]),), r == 0
    R, C = shape
    kind = name.split(".")[-2]  # embed, head, q, k, v, o, gate, up, down
    hd, per = cfg.head_size, cfg.heads // M  # query heads per rank

    def part(n: int) -> tuple[int, int]:
        return r * n // M, (r + 1) * n // M

    if kind in ("embed", "head", "gate", "up"):
        return (part(R), (0, C)), True
    if kind == "q":
        return ((r * per * hd, (r + 1) * per * hd), (0, C)), True
    if kind == "o":
        return ((0, R), (r * per * hd, (r + 1) * per * hd)), True
    if kind == "down":
        return ((0, R), part(C)), True
    # k, v: the K/V heads that rank r's query heads read (query head h reads K/V head h // group)
    group = cfg.group_size
    first, last = r * per // group, ((r + 1) * per - 1) // group  # K/V heads [first, last]
    sharing = max(1, M // cfg.kv_heads)  # ranks that hold the same K/V head
    return ((first * hd, (last + 1) * hd), (0, C)), r % sharing == 0


def _as_layout(value) -> tuple[tuple, bool] | str:
    """An answer as (box, writes), or what was wrong with it."""
    try:
        box, writes = value
        box = tuple((int(a), int(b)) for a, b in box)
    except (TypeError, ValueError):
        return f"not (box, writes): {repr(value)[:60]}"
    if not isinstance(writes, (bool, int)):
        return f"writes is {type(writes).__name__}, not a bool"
    return box, bool(writes)


def collect_tp_layout(tp_layout) -> dict:
    answers = {}
    with library_calls(LIBRARY) as called:
        for heads, kv_heads, M in LAYOUT_CASES:
            cfg = layout_config(heads, kv_heads)
            for name, p in build_lab_model(cfg).named_parameters():
                for r in range(M):
                    key = f"{heads}/{kv_heads}/{M}/{r}/{name}"
                    try:
                        answers[key] = _as_layout(tp_layout(name, list(p.shape), cfg, M, r))
                    except Exception as exc:  # one case breaks: it fails, the others are judged
                        answers[key] = f"raised {type(exc).__name__}: {str(exc)[:80]}"
    return {"answers": answers, "library": list(called)}


def _box_said(box) -> str:
    if len(box) == 1:
        return f"elements [{box[0][0]}, {box[0][1]})"
    return " x ".join(f"{what} [{a}, {b})" for what, (a, b) in zip(("rows", "columns"), box, strict=True))


def judge_tp_layout(data) -> list[str]:
    lines = [_library_line("tp_layout", data["library"])]
    for heads, kv_heads, M in LAYOUT_CASES:
        cfg = layout_config(heads, kv_heads)
        what = f"nq = {heads}, nkv = {kv_heads} on M = {M}: every rank's box of every tensor, each written once"
        wrong = None
        for name, p in build_lab_model(cfg).named_parameters():
            holders: dict[tuple, list[int]] = {}  # box -> the ranks that hold it
            answers = {r: data["answers"][f"{heads}/{kv_heads}/{M}/{r}/{name}"] for r in range(M)}
            for r in range(M):
                want, _ = tp_box(name, list(p.shape), cfg, M, r)
                holders.setdefault(want, []).append(r)
                got = answers[r] if isinstance(answers[r], str) else tuple(tuple(d) for d in answers[r][0])
                if got != want:
                    said = got if isinstance(got, str) else _box_said(got)
                    wrong = wrong or f"rank {r}, {name} {list(p.shape)}: expected {_box_said(want)}; received {said}"
            for box, ranks in holders.items():
                writers = [r for r in ranks if not isinstance(answers[r], str) and answers[r][1]]
                if len(writers) != 1:
                    wrong = wrong or (
                        f"{name} {list(p.shape)}: {_box_said(box)} is held by ranks {ranks}, written by "
                        f"{writers or 'none of them'} (expected: exactly one of them)"
                    )
        lines.append(f"{what}: PASS" if wrong is None else f"{what}: first wrong: {wrong}: FAIL")
    return lines


# ---- reshard: a ZeRO checkpoint of the lab model into the tensor-parallel boxes


def zero_save_lab_rank(root: str) -> None:
    """Rank code: ZeRO-2 trains the lab model SAVED_AT Adam steps on this rank's rows and saves its sharded
    checkpoint under root (parlab's own code: every rank its flat shard's pieces, rank 0 the metadata)."""
    P, rank = comm.group_size(), comm.group_rank()
    zero = ZeRO(build_lab_model(LAB, seed=0).to(parlab.device()), 2, lr=LR)
    for k, (x, y) in enumerate(LAB_BATCHES):
        b = len(x) // P
        x_r, y_r = x[rank * b : (rank + 1) * b].to(parlab.device()), y[rank * b : (rank + 1) * b].to(parlab.device())
        lab_loss(zero.model(x_r), y_r).backward()
        zero.step(k)
        zero.zero_grad()
    ckpt.save(root, SAVED_AT, ckpt.zero_pieces(zero), layout="zero-2", extra={"optimizer_step": zero.t})
    zero.remove()


def param_name(name: str) -> str:
    """The lab-model parameter a checkpoint tensor belongs to: model.X -> X, optim.X.exp_avg -> X."""
    name = name.removeprefix("model.").removeprefix("optim.")
    return name.rsplit(".", 1)[0] if name.endswith(ADAM) else name


def tp_rank(reshard, root: str, library: tuple) -> dict:
    """Rank code: rank r of M loads its box of every saved tensor with the student's reshard; the reads it made
    ({tensor: [(q, start, stop), ...]}, in order)."""
    M, r = comm.group_size(), comm.group_rank()
    folder = Path(root)
    meta = json.loads((folder / "metadata.json").read_text())
    files, reads, held = {}, {}, {}

    def read(name: str, pieces: dict, q, start, stop) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor `name`, from the piece rank q saved."""
        with outside_the_guard():
            if q not in pieces:
                raise ValueError(f"{name}: rank {q!r} saved no piece of it (pieces: ranks {sorted(pieces)})")
            a, b = pieces[q]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)) or not (
                a <= start < stop <= b
            ):
                raise ValueError(
                    f"{name}: read({q}, {start!r}, {stop!r}) is not a range inside rank {q}'s piece [{a}, {b})"
                )
            reads.setdefault(name, []).append((int(q), int(start), int(stop)))
            if q not in files:  # memory-mapped: only the bytes asked for are read
                files[q] = torch.load(folder / f"rank{int(q)}.pt", mmap=True, weights_only=True)
            return files[q][name][start - a : stop - a].clone()  # host: [stop - start] from the file, as a loader reads

    with library_calls(library) as called:
        for name, entry in meta["tensors"].items():
            shape = list(entry["shape"])
            box, _ = tp_box(param_name(name), shape, LAB, M, r)
            pieces = [dict(p) for p in entry["pieces"]]
            ranges = {p["rank"]: tuple(p["flat"]) for p in entry["pieces"]}
            held[name] = reshard(
                pieces, shape, box, lambda q, start, stop, n=name, g=ranges: read(n, g, q, start, stop)
            )
    return {"held": held, "reads": reads, "library": list(called)}


def collect_reshard(reshard) -> dict:
    root = tempfile.mkdtemp(prefix="parlab-lab11-")
    try:
        parlab.launch(zero_save_lab_rank, SAVED_BY, root, **LAUNCH)
        folder = ckpt.latest(root)
        reader = ckpt.Reader(folder)
        full = {n: reader.full(n) for n in reader.names()}
        meta = {n: [(p["rank"], *p["flat"]) for p in e["pieces"]] for n, e in reader.meta["tensors"].items()}
        ranks = {
            M: [dict(v) for v in parlab.launch(tp_rank, M, reshard, str(folder), LIBRARY, **LAUNCH)] for M in TP_WORLDS
        }
        return {"full": full, "meta": meta, "ranks": ranks}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _box_elements(shape: list[int], box: tuple) -> list[int]:
    """The flat (row-major) indices of a box's elements, in order."""
    index = torch.arange(math.prod(shape), device="cpu").view(shape)  # host: the judge's bookkeeping
    return index[tuple(slice(a, b) for a, b in box)].reshape(-1).tolist()


def fewest_reads(needed: list[int], starts: set[int]) -> int:
    """The fewest reads that take exactly the elements `needed` (sorted flat indices), each read a range of one
    piece (`starts`: where the pieces begin): the runs of consecutive indices, cut where a piece begins."""
    return sum(1 for i, e in enumerate(needed) if i == 0 or e != needed[i - 1] + 1 or e in starts)


def _badly_read(needed: list[int], reads: list) -> str | None:
    """What is wrong with the elements a rank read of one tensor (None: each element of its box exactly once)."""
    box, count = set(needed), {}
    for q, a, b in reads:
        outside = next((e for e in range(a, b) if e not in box), None)
        if outside is not None:
            return f"read [{a}, {b}) of rank {q}'s piece holds element {outside}, outside the box"
        for e in range(a, b):
            count[e] = count.get(e, 0) + 1
    twice = next((e for e in needed if count.get(e, 0) > 1), None)
    if twice is not None:
        return f"element {twice} read {count[twice]} times"
    missing = [e for e in needed if e not in count]
    return f"{len(missing)} elements of the box never read (the first: {missing[0]})" if missing else None


def judge_reshard(data) -> list[str]:
    full, meta = data["full"], data["meta"]
    lines = [_library_line("reshard", [c for ranks in data["ranks"].values() for d in ranks for c in d["library"]])]
    for M, ranks in data["ranks"].items():
        M, wrong, badly_read, too_many = int(M), None, None, None
        for r, d in enumerate(ranks):
            for name, whole in full.items():
                box, _ = tp_box(param_name(name), list(whole.shape), LAB, M, r)
                want = whole[tuple(slice(a, b) for a, b in box)]
                got = d["held"].get(name)
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    wrong = wrong or f"rank {r} {name}: expected shape {list(want.shape)}, received {_shape(got)}"
                elif not torch.equal(got.to(want.dtype), want):
                    i = int((got.to(want.dtype) - want).abs().reshape(-1).argmax())
                    wrong = wrong or (
                        f"rank {r} {name} (element {i} of its box, row-major): expected "
                        f"{float(want.reshape(-1)[i]):.6g}, received {float(got.reshape(-1)[i]):.6g}"
                    )
                needed = _box_elements(list(whole.shape), box)
                reads = [tuple(x) for x in d["reads"].get(name, [])]
                why = _badly_read(needed, reads)
                if why is not None and badly_read is None:
                    badly_read = f"rank {r} {name}, box {_box_said(box)}: {why}"
                fewest = fewest_reads(sorted(needed), {a for _, a, _ in meta[name]})
                if len(reads) > fewest and too_many is None:
                    too_many = (
                        f"rank {r} {name}, box {_box_said(box)}: {len(reads)} reads; the fewest that take exactly "
                        f"its elements (each a range of one saved piece): {fewest}"
                    )
        lines.append(
            f"M = {M}: every rank's box of every tensor (weights, Adam m and v) equals the checkpoint's: PASS"
            if wrong is None
            else f"M = {M}: every rank's box of every tensor (weights, Adam m and v): first wrong: {wrong}: FAIL"
        )
        what = f"M = {M}: each rank read every element of its boxes once and no other"
        lines.append(f"{what}: PASS" if badly_read is None else f"{what}: first wrong: {badly_read}: FAIL")
        what = f"M = {M}: each rank read its boxes in the fewest reads the saved pieces allow"
        lines.append(f"{what}: PASS" if too_many is None else f"{what}: first wrong: {too_many}: FAIL")
    lines.append(_put_together(data))
    return lines


def _put_together(data) -> str:
    """The weights of the M = 4 ranks, each box put in its place by one rank holding it (the first), against one
    device after SAVED_AT Adam steps."""
    M = max(TP_WORLDS)
    ranks = data["ranks"][M] if M in data["ranks"] else data["ranks"][str(M)]
    single = train_lab_single_device(LAB, LAB_BATCHES, 0, "adam", LR).params
    params = {}
    try:
        for n, want in single.items():
            params[n] = torch.full_like(want, float("nan"))
            for r, d in enumerate(ranks):
                box, writes = tp_box(n, list(want.shape), LAB, M, r)
                if writes:
                    params[n][tuple(slice(a, b) for a, b in box)] = d["held"][f"model.{n}"]
    except (KeyError, RuntimeError, TypeError) as exc:
        return f"M = {M}: the ranks' weights put back together: cannot ({type(exc).__name__}: {str(exc)[:80]}): FAIL"
    return compare(
        f"M = {M}: the ranks' weights put back together vs one device after {SAVED_AT} steps", params, single
    ).line


# ---- checkpoint_cost: a prediction


def checkpoint_cost_theory() -> dict[str, float]:
    """The prediction's theory: the bytes the busiest rank writes in a tensor-parallel checkpoint of the lab model on
    COST_M ranks (weights, Adam m and v in float64; each box several ranks hold written, with its m and v, by the
    one of them that keeps the busiest rank lightest), the interval that loses the least time and the percent lost
    at it."""
    mtbf = DEVICE_MTBF_HOURS * 3600 / DEVICES
    tau = _best_interval(mtbf)
    return {
        "busiest_bytes": 3 * 8 * writer_plan(LAB, COST_M)[1],
        "tau_minutes": tau / 60,
        "lost_percent": 100 * _lost_fraction(tau, mtbf),
    }


def writer_plan(cfg: LabConfig, M: int) -> tuple[dict[str, dict[tuple, int]], int]:
    """Who writes each box of a tensor-parallel checkpoint on M ranks ({tensor: {box: rank}}) so that the busiest
    rank writes the fewest elements (of the weights; m and v follow them), and that number. A box one rank holds is
    its own; a box several hold goes to one of them: an exhaustive search over those, largest first, pruned by the
    best found so far."""
    plan: dict[str, dict[tuple, int]] = {}
    load, shared = [0] * M, []  # elements each rank must write; (elements, tensor, box, holders) of shared boxes
    for name, p in build_lab_model(cfg).named_parameters():
        holders: dict[tuple, list[int]] = {}
        for r in range(M):
            holders.setdefault(tp_box(name, list(p.shape), cfg, M, r)[0], []).append(r)
        plan[name] = {}
        for box, ranks in holders.items():
            n = math.prod(b - a for a, b in box)
            if len(ranks) == 1:
                plan[name][box] = ranks[0]
                load[ranks[0]] += n
            else:
                shared.append((n, name, box, ranks))
    shared.sort(key=lambda s: -s[0])
    best = [math.inf, []]

    def search(i: int, choice: list[int]) -> None:
        if max(load) >= best[0]:
            return
        if i == len(shared):
            best[:] = [max(load), list(choice)]
            return
        n, _, _, ranks = shared[i]
        for r in sorted(ranks, key=lambda r: load[r]):
            load[r] += n
            search(i + 1, [*choice, r])
            load[r] -= n

    search(0, [])
    for (_, name, box, _), r in zip(shared, best[1], strict=True):
        plan[name][box] = r
    return plan, int(best[0])


def tp_save_rank(root: str, plan: dict[str, dict[tuple, int]]) -> int:
    """Rank code: the lab model after one Adam step on one device's whole batch, saved as a tensor-parallel
    checkpoint on COST_M ranks (parlab's writer: each rank the boxes `plan` gives it, with their m and v; rank 0
    the metadata); the bytes this rank wrote."""
    M, r = comm.group_size(), comm.group_rank()
    model = build_lab_model(LAB, seed=0).to(parlab.device())
    opt = make_optimizer(model.parameters(), "adam", LR)
    x, y = (t.to(parlab.device()) for t in LAB_BATCHES[0])
    lab_loss(model(x), y).backward()
    opt.step()
    pieces = []
    for name, p in model.named_parameters():
        box, _ = tp_box(name, list(p.shape), LAB, M, r)
        if plan[name][box] != r:
            continue
        cut = tuple(slice(a, b) for a, b in box)
        starts = tuple(a for a, _ in box)
        for key, tensor in [("model", p), *((k, opt.state[p][k]) for k in ADAM)]:
            label = f"model.{name}" if key == "model" else f"optim.{name}.{key}"
            pieces.append(ckpt.Piece(label, tensor.detach()[cut].clone(), tuple(p.shape), offsets=starts))
    ckpt.save(root, 1, pieces, layout="tp", extra={"optimizer_step": 1})
    return sum(piece.data.numel() * piece.data.element_size() for piece in pieces)


def collect_checkpoint_cost(busiest_bytes, tau_minutes, lost_percent) -> dict:
    root = tempfile.mkdtemp(prefix="parlab-lab11-")
    try:
        plan, _ = writer_plan(LAB, COST_M)
        written = parlab.launch(tp_save_rank, COST_M, root, plan, **LAUNCH)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"predicted": [_plain(v) for v in (busiest_bytes, tau_minutes, lost_percent)], "measured": max(written)}


def _plain(value):
    """A prediction as plain data for the grader (a number stays a number; anything else its text)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return value if isinstance(value, (int, float)) else repr(value)[:80]


def _lost_fraction(tau: float, mtbf: float) -> float:
    """The fraction of the time lost with a checkpoint started every tau seconds (tau >= PAUSE_S + WRITE_S; failures
    rare: at most one per interval, at a time t uniform over [0, tau) after a checkpoint's pause began): the pauses,
    and per failure the restart and the time since the pause of the last COMPLETE checkpoint began. A checkpoint is
    complete PAUSE_S + WRITE_S after its pause began: before that, the last complete one began tau earlier."""
    complete = PAUSE_S + WRITE_S
    during = (complete**2 / 2 + tau * complete) / tau  # the integral of (t + tau) over [0, complete), / tau
    after = (tau**2 - complete**2) / 2 / tau  # the integral of t over [complete, tau), / tau
    return PAUSE_S / tau + (during + after + RESTART_S) / mtbf


def _best_interval(mtbf: float) -> float:
    """The interval that loses the least time, by ternary search (the loss is convex in tau)."""
    lo, hi = float(PAUSE_S + WRITE_S), mtbf
    for _ in range(100):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (lo, b) if _lost_fraction(a, mtbf) < _lost_fraction(b, mtbf) else (a, hi)
    return (lo + hi) / 2


def judge_checkpoint_cost(data) -> list[str]:
    theory = THEORY["checkpoint_cost"]()
    busiest_bytes, tau_minutes, lost_percent = data["predicted"]
    lines = prediction_lines(
        f"bytes the busiest rank writes (tensor-parallel, M = {COST_M}, Adam, float64, writers chosen at best)",
        busiest_bytes,
        theory["busiest_bytes"],
        data["measured"],
        rtol=0,
    )
    lines += prediction_lines(
        "the interval that loses the least time (minutes)", tau_minutes, theory["tau_minutes"], rtol=0.002
    )
    lines += prediction_lines(
        "percent of the time lost at that interval", lost_percent, theory["lost_percent"], rtol=0.002
    )
    return lines


# The predictions' theory, one home: the judge scores against these functions.
THEORY = {"checkpoint_cost": checkpoint_cost_theory}
