"""Lab 11's checks: surviving dead ranks, the tensor-parallel layout of the lab model, and the reshard of a ZeRO
checkpoint of the lab model into that layout on another number of ranks, on live ranks (see parlab/grading).

    part 1  survive          relaunch on the survivors as ranks keep dying (the lessons' GPT, ZeRO-3, Adam)
    part 2  tp_layout        the box of every lab-model tensor each of M tensor-parallel ranks holds, and who writes
                             it: attention cut by query heads, each rank with the K/V heads its queries read (GQA:
                             replicated when M exceeds the K/V heads), row-parallel matrices cut by columns
    part 3  reshard          a ZeRO checkpoint of the lab model written by 3 ranks, loaded into those boxes on M = 2
                             and 4 ranks, reading only the saved pieces each box overlaps
    predict checkpoint_cost  the bytes rank 0 writes for a tensor-parallel checkpoint (M = 4), the best interval and
                             the time lost with asynchronous checkpoints

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
from parlab.core.models import GPTConfig, make_batches, make_optimizer, train_single_device
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.schemes.faults import checkpoint as ckpt
from parlab.schemes.faults.failures import FaultPlan, resumable_rank
from parlab.schemes.zero.stages import ZeRO

LAUNCH = {"timeout": 60, "echo": False}
# Part 1: the lessons' small GPT (float64, Psi = 7,744), ZeRO-3 with Adam, global batch 12, 6 steps.
CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float64")
B, STEPS, LR = 12, 6, 1e-3
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
# then is written in the background for WRITE_S; a restart takes RESTART_S. Its checkpoint: the lab model on COST_M.
DEVICE_MTBF_HOURS, DEVICES, PAUSE_S, WRITE_S, RESTART_S = 50_000, 4096, 6, 120, 300
COST_M = 4
ADAM = ("exp_avg", "exp_avg_sq")  # the checkpoint's names of Adam's m and v: optim.<parameter>.exp_avg, ...

# parlab's own code for what the parts ask (parlab/grading/labs/guard.py): checkpoints, failures, their runs and
# lesson helpers, and the tensor-parallel layout of the lessons' GPT.
LIBRARY = ("schemes/faults/", "runs/checkpoint.py", "lessons/fault_tolerance.py", "schemes/tensor_parallel.py")

STRUCTURAL = {
    "survive": "ZeRO-3 on 4 ranks, rank 2 dies in step 5, then in the relaunch on 3 ranks rank 1 dies in step 6 "
    "(each a RankError): your code relaunches on 3, then on 2 ranks, each time resuming from the checkpoint of step "
    "4 (not from scratch); the final parameters equal one device; a launch that fails before any rank starts (a "
    "ValueError: no rank died) is not retried, its error reaches the caller; no call into parlab's fault-tolerance "
    "code",
    "tp_layout": "for the lab model's every tensor on M tensor-parallel ranks (GQA with K/V heads split, replicated "
    "when M exceeds them, multi-head and multi-query attention; M = 1 to 8): each rank's box (rows, columns) equals "
    "Megatron's cut by query heads, K/V heads, F and vocabulary rows, and exactly one rank (the first holding it) "
    "writes each box; the first wrong box shown with expected and received; no call into parlab's code",
    "reshard": "a ZeRO checkpoint of the lab model written by 3 ranks, loaded into each rank's tensor-parallel box "
    "on M = 2 and 4 ranks: every rank's part of every tensor (weights, Adam m and v) equals the checkpoint's "
    "exactly, with the box's shape; your code read exactly the saved pieces that overlap the box (column boxes: "
    "strided rows), no more, no fewer; the weights put back together equal one device after the same steps; no "
    "call into parlab's checkpoint code",
    "checkpoint_cost": "the bytes rank 0 writes for a tensor-parallel checkpoint of the lab model on 4 ranks "
    "(weights, Adam m and v, every element once; measured from a real save), the best interval and the time lost "
    "with asynchronous checkpoints and restarts, against the prediction (THEORY)",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def single_device(steps: int = STEPS) -> dict[str, torch.Tensor]:
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


# ---- survive: catch the failure, relaunch on the survivors


# Who dies in which launch: (rank, 1-based step), by launch number. The relaunch on 3 ranks resumes from step 4 and
# loses a rank in step 6, before any newer checkpoint: the launch after it resumes from step 4 again.
DEATHS = {1: (2, 5), 2: (1, 6)}
MAX_LAUNCHES = 8  # a survive() that relaunches more often than this is stopped by the check (it would never end)


class TooManyLaunches(BaseException):
    """The check stops a survive() that keeps relaunching (a BaseException: `except Exception` does not catch it)."""


def _count(calls: list, world_size: int, resume: bool) -> None:
    calls.append((int(world_size), bool(resume)))
    if len(calls) > MAX_LAUNCHES:
        raise TooManyLaunches(f"stopped by the check after {MAX_LAUNCHES} launches")


def collect_survive(survive) -> dict:
    root, calls = tempfile.mkdtemp(prefix="parlab-lab11-"), []

    def launch_run(world_size: int, resume: bool):
        """Train ZeRO-3 on `world_size` ranks (resume: from the newest checkpoint); one rank of the first launch
        and one of the second die (DEATHS). Returns the ranks' results (each: "params", "start": the step it
        resumed from)."""
        _count(calls, world_size, resume)
        kill_rank, at_step = DEATHS.get(len(calls), (None, 0))
        with outside_the_guard():
            plan = FaultPlan(root, every=2, kill_rank=kill_rank, at_step=at_step, resume=bool(resume))
            return parlab.launch(
                resumable_rank, world_size, "zero", CFG, BATCHES, plan, optimizer="adam", lr=LR, stage=3, **LAUNCH
            )

    called = []
    try:
        try:
            with library_calls(LIBRARY) as called:
                results = survive(launch_run, 4)
            data = {"calls": calls, "world": len(results), "start": results[0]["start"], "params": results[0]["params"]}
        except (parlab.RankError, TooManyLaunches) as exc:  # a death let through to the caller, or no end
            why = f"a RankError reached the caller (rank {exc.rank} died)" if isinstance(exc, parlab.RankError) else exc
            data = {"calls": calls, "world": 0, "start": None, "params": None, "unfinished": str(why)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    data["other_error"] = _other_error(survive, called)
    data["library"] = list(called)
    return data


def _other_error(survive, called: list[str]) -> dict:
    """survive() once more, with a launch that fails before any rank starts, as parlab.launch does on a bad argument:
    no rank died, so there is nothing to relaunch on fewer ranks; the error must reach the caller. Starts nothing."""
    calls = []

    def launch_run(world_size: int, resume: bool):
        _count(calls, world_size, resume)
        raise ValueError("the check's own error: a bad argument, found before any rank started")

    try:
        with library_calls(LIBRARY) as more:
            survive(launch_run, 4)
        raised = "nothing"
    except Exception as exc:
        raised = type(exc).__name__
    except TooManyLaunches as exc:
        raised = f"nothing ({exc})"
    finally:
        called += [c for c in more if c not in called]
    return {"calls": calls, "raised": raised}


def judge_survive(data) -> list[str]:
    calls = [tuple(c) for c in data["calls"]]
    ok = calls == [(4, False), (3, True), (2, True)]
    lines = [_library_line("survive", data["library"])]
    expected = "[(4, False), (3, True), (2, True)]"
    lines.append(
        f"launches: {calls} (4 ranks; after each failure one fewer, resuming): PASS"
        if ok
        else f"launches: expected {expected} (4 ranks; after each failure one fewer, resuming), received {calls}: FAIL"
    )
    if data.get("unfinished"):
        lines.append(f"{data['unfinished']}; the job was not finished: FAIL")
    else:
        world, start = data["world"], data["start"]
        ended = f"the run ended on {world} ranks, the survivors"
        lines.append(f"{ended}: PASS" if world == 2 else f"{ended}: expected 2: FAIL")
        lines.append(f"resumed from step {start} (the last checkpoint: 4): {'PASS' if start == 4 else 'FAIL'}")
        lines.append(compare("final parameters after the restarts", data["params"], single_device()).line)
    other = data["other_error"]
    other_calls = [tuple(c) for c in other["calls"]]
    ok = other_calls == [(4, False)] and other["raised"] == "ValueError"
    verdict = "PASS" if ok else "FAIL"
    lines.append(
        f"a launch that fails before any rank starts (ValueError, no rank died): launches {other_calls}, "
        f"the caller got {other['raised']} (expected: [(4, False)], ValueError): {verdict}"
    )
    return lines


# ---- tp_layout: the lab model's tensor-parallel layout, GQA included


def layout_config(heads: int, kv_heads: int) -> LabConfig:
    """tp_layout's models: one block of the lab model with H = 32, V = F = 64 and the given attention heads."""
    return LabConfig(hidden=32, heads=heads, kv_heads=kv_heads, layers=1)


def tp_box(name: str, shape: list[int], cfg: LabConfig, M: int, r: int) -> tuple[tuple, bool]:
    """The judge's own layout: rank r of M's box of the lab-model tensor `name` ((start, stop) per dimension) and
    whether r writes it (the first rank holding that box).

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


def _said(layout) -> str:
    if isinstance(layout, str):
        return layout
    box, writes = layout
    dims = " x ".join(f"{what} [{a}, {b})" for what, (a, b) in zip(("rows", "columns"), box, strict=False))
    return f"{dims}, {'writes it' if writes else 'does not write it'}"


def judge_tp_layout(data) -> list[str]:
    lines = [_library_line("tp_layout", data["library"])]
    for heads, kv_heads, M in LAYOUT_CASES:
        cfg = layout_config(heads, kv_heads)
        what = f"nq = {heads}, nkv = {kv_heads} on M = {M}: every rank's box of every tensor, and who writes it"
        wrong = None
        for name, p in build_lab_model(cfg).named_parameters():
            for r in range(M):
                want = tp_box(name, list(p.shape), cfg, M, r)
                got = data["answers"][f"{heads}/{kv_heads}/{M}/{r}/{name}"]
                if got != want and not (isinstance(got, (list, tuple)) and tuple(got) == want):
                    wrong = wrong or f"rank {r}, {name} {list(p.shape)}: expected {_said(want)}; received {_said(got)}"
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
    """Rank code: rank r of M loads its box of every saved tensor with the student's reshard; the reads it made."""
    M, r = comm.group_size(), comm.group_rank()
    folder = Path(root)
    meta = json.loads((folder / "metadata.json").read_text())
    files, reads, held = {}, [], {}

    def read(q: int, name: str) -> torch.Tensor:
        with outside_the_guard():
            reads.append((int(q), name))
            if q not in files:  # memory-mapped: only the bytes asked for are read
                files[q] = torch.load(folder / f"rank{int(q)}.pt", mmap=True, weights_only=True)
            return files[q][name].clone()

    with library_calls(library) as called:
        for name, entry in meta["tensors"].items():
            shape = list(entry["shape"])
            box, _ = tp_box(param_name(name), shape, LAB, M, r)
            pieces = [dict(p) for p in entry["pieces"]]
            held[name] = reshard(pieces, shape, box, lambda q, name=name: read(q, name))
    return {"held": held, "reads": sorted(set(reads)), "library": list(called)}


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


def _box_elements(shape: list[int], box: tuple) -> torch.Tensor:
    """The flat (row-major) indices of a box's elements: [rows, columns] (a vector: [n])."""
    index = torch.arange(math.prod(shape), device="cpu").view(shape)  # host: the judge's bookkeeping
    return index[tuple(slice(a, b) for a, b in box)]


def judge_reshard(data) -> list[str]:
    full, meta = data["full"], data["meta"]
    lines = [_library_line("reshard", [c for ranks in data["ranks"].values() for d in ranks for c in d["library"]])]
    for M, ranks in data["ranks"].items():
        M, wrong, badly_read = int(M), None, None
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
                overlap = {q for q, a, b in meta[name] if bool(((needed >= a) & (needed < b)).any())}
                read = {int(q) for q, n in d["reads"] if n == name}
                if read != overlap and badly_read is None:
                    badly_read = (
                        f"rank {r} {name}: box {[list(x) for x in box]} overlaps the pieces saved by ranks "
                        f"{sorted(overlap)}, read {sorted(read)}"
                    )
        lines.append(
            f"M = {M}: every rank's box of every tensor (weights, Adam m and v) equals the checkpoint's: PASS"
            if wrong is None
            else f"M = {M}: every rank's box of every tensor (weights, Adam m and v): first wrong: {wrong}: FAIL"
        )
        lines.append(
            f"M = {M}: each rank read exactly the saved pieces its box overlaps: PASS"
            if badly_read is None
            else f"M = {M}: each rank read exactly the saved pieces its box overlaps: first wrong: {badly_read}: FAIL"
        )
    lines.append(_put_together(data))
    return lines


def _put_together(data) -> str:
    """The weights of the M = 4 ranks, each box put in its place by the rank that writes it, against one device
    after SAVED_AT Adam steps."""
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
    """The prediction's theory: rank 0's bytes in a tensor-parallel checkpoint of the lab model on COST_M ranks
    (weights, Adam m and v in float64; a box held by several ranks written by the first), the interval that loses
    the least time and the percent lost at it."""
    mtbf = DEVICE_MTBF_HOURS * 3600 / DEVICES
    tau = _best_interval(mtbf)
    return {
        "rank0_bytes": 3 * 8 * _rank0_elements(),
        "tau_minutes": tau / 60,
        "lost_percent": 100 * _lost_fraction(tau, mtbf),
    }


def _rank0_elements() -> int:
    total = 0
    for name, p in build_lab_model(LAB).named_parameters():
        box, writes = tp_box(name, list(p.shape), LAB, COST_M, 0)
        total += math.prod(b - a for a, b in box) if writes else 0
    return total


def tp_save_rank(root: str) -> int:
    """Rank code: the lab model after one Adam step on one device's whole batch, saved as a tensor-parallel
    checkpoint on COST_M ranks (parlab's writer: each rank its boxes, rank 0 the metadata); the bytes this rank
    wrote."""
    M, r = comm.group_size(), comm.group_rank()
    model = build_lab_model(LAB, seed=0).to(parlab.device())
    opt = make_optimizer(model.parameters(), "adam", LR)
    x, y = (t.to(parlab.device()) for t in LAB_BATCHES[0])
    lab_loss(model(x), y).backward()
    opt.step()
    pieces = []
    for name, p in model.named_parameters():
        box, writes = tp_box(name, list(p.shape), LAB, M, r)
        if not writes:
            continue
        cut = tuple(slice(a, b) for a, b in box)
        starts = tuple(a for a, _ in box)
        for key, tensor in [("model", p), *((k, opt.state[p][k]) for k in ADAM)]:
            label = f"model.{name}" if key == "model" else f"optim.{name}.{key}"
            pieces.append(ckpt.Piece(label, tensor.detach()[cut].clone(), tuple(p.shape), offsets=starts))
    ckpt.save(root, 1, pieces, layout="tp", extra={"optimizer_step": 1})
    return sum(piece.data.numel() * piece.data.element_size() for piece in pieces)


def collect_checkpoint_cost(rank0_bytes, tau_minutes, lost_percent) -> dict:
    root = tempfile.mkdtemp(prefix="parlab-lab11-")
    try:
        measured = parlab.launch(tp_save_rank, COST_M, root, **LAUNCH)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"predicted": [_plain(v) for v in (rank0_bytes, tau_minutes, lost_percent)], "measured": measured}


def _plain(value):
    """A prediction as plain data for the grader (a number stays a number; anything else its text)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return value if isinstance(value, (int, float)) else repr(value)[:80]


def _lost_fraction(tau: float, mtbf: float, grid: int = 20_000) -> float:
    """The fraction of the time lost with a checkpoint started every tau seconds, averaged over failure times on a
    grid: the pauses, and per failure the restart and the work since the state of the last COMPLETE checkpoint."""
    redone = 0.0
    for k in range(grid):
        t = (k + 0.5) * tau / grid  # the failure, t seconds after a checkpoint started
        redone += t if t >= WRITE_S else t + tau  # during the write, that checkpoint is not there yet
    return PAUSE_S / tau + (redone / grid + RESTART_S) / mtbf


def _best_interval(mtbf: float) -> float:
    """The interval that loses the least time, by ternary search (the loss is convex in tau)."""
    lo, hi = float(WRITE_S), mtbf
    for _ in range(100):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (lo, b) if _lost_fraction(a, mtbf, 2_000) < _lost_fraction(b, mtbf, 2_000) else (a, hi)
    return (lo + hi) / 2


def judge_checkpoint_cost(data) -> list[str]:
    theory = THEORY["checkpoint_cost"]()
    rank0_bytes, tau_minutes, lost_percent = data["predicted"]
    lines = prediction_lines(
        f"bytes rank 0 writes (tensor-parallel, M = {COST_M}, Adam, float64)",
        rank0_bytes,
        theory["rank0_bytes"],
        data["measured"],
    )
    lines += prediction_lines("the interval that loses the least time (minutes)", tau_minutes, theory["tau_minutes"])
    lines += prediction_lines("percent of the time lost at that interval", lost_percent, theory["lost_percent"])
    return lines


# The predictions' theory, one home: the judge scores against these functions.
THEORY = {"checkpoint_cost": checkpoint_cost_theory}
