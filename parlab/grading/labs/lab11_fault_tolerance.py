"""Lab 11's checks: surviving a dead rank, where a ZeRO checkpoint put each tensor, and the reshard of a ZeRO-3
checkpoint into a tensor-parallel layout on another number of ranks, on live ranks (see parlab/grading).

The training: the small GPT (float64, Psi = 7,744), ZeRO-3 with Adam, global batch 12, checkpoints written by
parlab.schemes.faults.checkpoint (every rank its pieces, rank 0 the metadata). What a student's reshard read is recorded
through the `read` function it is given; what the loading ranks hold is compared with the checkpoint's tensors and with
one device that trained as many steps.
"""

from __future__ import annotations

import shutil
import tempfile

import torch

import parlab
from parlab.core import comm
from parlab.core.check import compare
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches, make_optimizer, train_single_device
from parlab.grading.labs import prediction_lines, run_check
from parlab.schemes.faults import checkpoint as ckpt
from parlab.schemes.faults.failures import FaultPlan, resumable_rank
from parlab.schemes.zero.stages import ZeRO

LAUNCH = {"timeout": 60, "echo": False}
CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float64")  # Psi = 7,744
B, STEPS, SAVED_AT, LR = 12, 6, 3, 1e-3
SAVED_BY = 3  # the ZeRO-3 checkpoint of parts 2 and 3 is written by 3 ranks: no unit of the GPT divides by 3
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T]
CASES = [([10], 4), ([3, 5, 2], 4), ([7, 1, 9, 4], 3), ([2], 5), ([16, 16, 256], 3), ([5, 5], 1)]  # (numels, N)
TP_WORLDS = (2, 3)  # the reshard's M: 3 does not divide 8 rows (wpe) nor 16 nor 64
# the prediction's cluster: devices, each failing every DEVICE_MTBF_HOURS; a checkpoint pauses training PAUSE_S,
# then is written in the background for WRITE_S; a restart takes RESTART_S
DEVICE_MTBF_HOURS, DEVICES, PAUSE_S, WRITE_S, RESTART_S = 50_000, 4096, 6, 120, 300
KEYS = ("model.{}", "optim.{}.exp_avg", "optim.{}.exp_avg_sq")

STRUCTURAL = {
    "survive": "ZeRO-3 on 4 ranks, rank 2 dies in step 5, then in the relaunch on 3 ranks rank 1 dies in step 6 "
    "(each a RankError): your code relaunches on 3, then on 2 ranks, each time resuming from the checkpoint of step "
    "4 (not from scratch); the final parameters equal one device; and a launch that fails before any rank starts "
    "(a ValueError: no rank died) is not retried, its error reaches the caller",
    "shard_pieces": "every tensor's (rank, start, stop) pieces, for units whose size N does not divide, with "
    "ranks that hold only padding, against the judge's own cut and against the metadata of a real ZeRO-3 checkpoint "
    "written by 3 ranks (no unit divides by 3)",
    "reshard": "a ZeRO-3 checkpoint of 3 ranks loaded into a tensor-parallel layout on 2 and on 3 ranks: every "
    "rank's rows of every matrix and every whole vector (weights, m, v) equal the checkpoint's exactly, with the "
    "right shapes; your code read exactly the saved pieces that overlap what the rank needs; the weights put back "
    "together equal one device after the same steps",
    "checkpoint_cost": "the bytes a plain-DP checkpoint of Adam's state takes (measured from a real save), the best "
    "interval and the time lost with asynchronous checkpoints and restarts, against the prediction",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def single_device(steps: int = STEPS) -> dict[str, torch.Tensor]:
    return train_single_device(CFG, BATCHES[:steps], 0, "adam", LR).params


def _shape(x) -> list[int] | str:
    return list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


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
        plan = FaultPlan(root, every=2, kill_rank=kill_rank, at_step=at_step, resume=bool(resume))
        return parlab.launch(
            resumable_rank, world_size, "zero", CFG, BATCHES, plan, optimizer="adam", lr=LR, stage=3, **LAUNCH
        )

    try:
        try:
            results = survive(launch_run, 4)
            data = {"calls": calls, "world": len(results), "start": results[0]["start"], "params": results[0]["params"]}
        except (parlab.RankError, TooManyLaunches) as exc:  # a death let through to the caller, or no end
            why = f"a RankError reached the caller (rank {exc.rank} died)" if isinstance(exc, parlab.RankError) else exc
            data = {"calls": calls, "world": 0, "start": None, "params": None, "unfinished": str(why)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    data["other_error"] = _other_error(survive)
    return data


def _other_error(survive) -> dict:
    """survive() once more, with a launch that fails before any rank starts, as parlab.launch does on a bad argument:
    no rank died, so there is nothing to relaunch on fewer ranks; the error must reach the caller. Starts nothing."""
    calls = []

    def launch_run(world_size: int, resume: bool):
        _count(calls, world_size, resume)
        raise ValueError("the check's own error: a bad argument, found before any rank started")

    try:
        survive(launch_run, 4)
        raised = "nothing"
    except Exception as exc:
        raised = type(exc).__name__
    except TooManyLaunches as exc:
        raised = f"nothing ({exc})"
    return {"calls": calls, "raised": raised}


def judge_survive(data) -> list[str]:
    calls = [tuple(c) for c in data["calls"]]
    ok = calls == [(4, False), (3, True), (2, True)]
    lines = [f"launches: {calls} (4 ranks; after each failure one fewer, resuming): {'PASS' if ok else 'FAIL'}"]
    if data.get("unfinished"):
        lines.append(f"{data['unfinished']}; the job was not finished: FAIL")
    else:
        world, start = data["world"], data["start"]
        lines.append(f"the run ended on {world} ranks, the survivors: {'PASS' if world == 2 else 'FAIL'}")
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


# ---- shard_pieces: where a ZeRO checkpoint put each tensor


def reference_pieces(numels: list[int], N: int) -> list[list[tuple[int, int, int]]]:
    """The judge's own cut, element by element: for each tensor, [(rank, start, stop)] in rank order."""
    S = -(-sum(numels) // N)  # the padded buffer has N * S elements
    owner = [e // S for e in range(sum(numels))]  # the rank that holds each element of the flat buffer
    out, offset = [], 0
    for n in numels:
        mine, pieces = owner[offset : offset + n], []
        for k, q in enumerate(mine):
            if pieces and pieces[-1][0] == q:
                pieces[-1][2] = k + 1
            else:
                pieces.append([q, k, k + 1])
        out.append([tuple(p) for p in pieces])
        offset += n
    return out


def _saved_checkpoint(root: str) -> None:
    """ZeRO-3 on SAVED_BY ranks trains SAVED_AT steps and saves under root (parlab's own code)."""
    from parlab.runs.checkpoint import zero_save_rank

    parlab.launch(zero_save_rank, SAVED_BY, CFG, BATCHES[:SAVED_AT], root, lr=LR, **LAUNCH)


def _as_pieces(value) -> list | str:
    """A student's answer as [[(rank, start, stop), ...] per tensor], or a description of what it was."""
    try:
        return [[tuple(int(v) for v in p) for p in tensor] for tensor in value]
    except (TypeError, ValueError):
        return f"not a list of lists of (rank, start, stop): {type(value).__name__}"


def collect_shard_pieces(shard_pieces) -> dict:
    answers = {f"{numels}/{N}": _as_pieces(shard_pieces(list(numels), N)) for numels, N in CASES}
    root = tempfile.mkdtemp(prefix="parlab-lab11-")
    try:
        _saved_checkpoint(root)
        reader = ckpt.Reader(ckpt.latest(f"{root}/parlab"))
        real = {}
        for k, u in enumerate(ZeRO(build_model(CFG), 3, lr=LR).units):  # what parlab's ranks saved
            saved = [[(p["rank"], *p["flat"]) for p in reader.meta["tensors"][f"model.{n}"]["pieces"]] for n in u.names]
            yours = _as_pieces(shard_pieces([p.numel() for p in u.params], SAVED_BY))
            real[f"unit {k} {[p.numel() for p in u.params]}"] = (
                [[tuple(map(int, p)) for p in t] for t in saved],
                yours,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"answers": answers, "real": real}


def _first_difference(expected: list, got) -> str:
    if isinstance(got, str):
        return got
    if len(got) != len(expected):
        return f"{len(got)} lists for {len(expected)} tensors"
    i = next(i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if sorted(a) != sorted(b))
    return f"tensor {i}: expected {expected[i]}, got {got[i]}"


def judge_shard_pieces(data) -> list[str]:
    lines = []
    for numels, N in CASES:
        expected, got = reference_pieces(numels, N), data["answers"][f"{numels}/{N}"]
        ok = (
            not isinstance(got, str)
            and len(got) == len(expected)
            and all(sorted(a) == sorted(b) for a, b in zip(expected, got, strict=True))
        )
        said = "right" if ok else f"wrong: {_first_difference(expected, got)}"
        lines.append(f"tensors {numels} over N = {N}: every tensor's pieces {said}: {'PASS' if ok else 'FAIL'}")
    bad = []
    for unit, (saved, yours) in data["real"].items():
        if (
            isinstance(yours, str)
            or len(yours) != len(saved)
            or any(sorted(a) != sorted(b) for a, b in zip(saved, yours, strict=True))
        ):
            bad.append(f"{unit}: {_first_difference(saved, yours)}")
    said = f"{len(data['real'])} units agree" if not bad else f"first disagreement: {bad[0]}"
    lines.append(f"the metadata of a real ZeRO-3 checkpoint (N = {SAVED_BY}): {said}: {'PASS' if not bad else 'FAIL'}")
    return lines


# ---- reshard: ZeRO-3 on N ranks -> tensor-parallel rows on M ranks


def tp_rows(R: int, M: int, r: int) -> tuple[int, int]:
    """The judge's own convention: rank r of M holds rows [floor(r R / M), floor((r + 1) R / M))."""
    return r * R // M, (r + 1) * R // M


def tp_rank(reshard, root: str) -> dict:
    """Rank code: rank r of M loads its tensor-parallel part of every saved tensor with the student's reshard."""
    M, r = comm.group_size(), comm.group_rank()
    reader = ckpt.Reader(ckpt.latest(f"{root}/parlab"))
    reads, held = [], {}

    def read(rank: int, name: str) -> torch.Tensor:
        reads.append((int(rank), name))
        return reader._piece(int(rank), name).clone()

    for name in reader.names():
        entry = reader.meta["tensors"][name]
        held[name] = reshard(entry["pieces"], list(entry["shape"]), M, r, lambda q, name=name: read(q, name))
    return {"held": held, "reads": sorted(set(reads))}


def collect_reshard(reshard) -> dict:
    root = tempfile.mkdtemp(prefix="parlab-lab11-")
    try:
        _saved_checkpoint(root)
        reader = ckpt.Reader(ckpt.latest(f"{root}/parlab"))
        full = {n: reader.full(n) for n in reader.names()}
        meta = {n: [(p["rank"], *p["flat"]) for p in e["pieces"]] for n, e in reader.meta["tensors"].items()}
        ranks = {M: [dict(v) for v in parlab.launch(tp_rank, M, reshard, root, **LAUNCH)] for M in TP_WORLDS}
        return {"full": full, "meta": meta, "ranks": ranks}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _needed(full: torch.Tensor, R: int, M: int, r: int) -> tuple[int, int]:
    """The range of the tensor's flattened elements rank r needs (a vector: all of it)."""
    if full.dim() < 2:
        return 0, full.numel()
    lo, hi = tp_rows(R, M, r)
    row = full.numel() // R
    return lo * row, hi * row


def judge_reshard(data) -> list[str]:
    full, meta, lines = data["full"], data["meta"], []
    for M, ranks in data["ranks"].items():
        M, wrong, first, extra, missing = int(M), 0, None, 0, 0
        for r, d in enumerate(ranks):
            for name, whole in full.items():
                R = whole.shape[0]
                want = whole[slice(*tp_rows(R, M, r))] if whole.dim() >= 2 else whole
                got = d["held"].get(name)
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    wrong += 1
                    first = first or f"rank {r} {name}: expected shape {list(want.shape)}, got {_shape(got)}"
                elif not torch.equal(got.to(want.dtype), want):
                    wrong += 1
                    diff = (got.to(want.dtype) - want).abs().max().item()
                    first = first or f"rank {r} {name}: max |diff| {diff:.1e}"
                a, b = _needed(whole, R, M, r)
                needed = {(q, name) for q, s, t in meta[name] if max(s, a) < min(t, b)}
                read = {(int(q), n) for q, n in d["reads"] if n == name}
                extra, missing = extra + len(read - needed), missing + len(needed - read)
        said = "all equal the checkpoint's" if not wrong else f"{wrong} wrong, first: {first}"
        lines.append(
            f"M = {M}: every rank's rows of each matrix and whole vectors (weights, m, v): {said}: "
            f"{'PASS' if not wrong else 'FAIL'}"
        )
        ok = extra == 0 and missing == 0
        lines.append(
            f"M = {M}: saved pieces read beyond those overlapping what each rank needs: {extra}, missing: "
            f"{missing}: {'PASS' if ok else 'FAIL'}"
        )
    lines.append(_put_together(data))
    return lines


def _put_together(data) -> str:
    """The weights of the widest M's ranks, rows stacked back in rank order, against one device after SAVED_AT."""
    M = max(int(m) for m in data["ranks"])
    ranks = data["ranks"][M] if M in data["ranks"] else data["ranks"][str(M)]
    single = single_device(SAVED_AT)
    try:
        params = {}
        for n in single:
            parts = [d["held"][f"model.{n}"] for d in ranks]
            params[n] = torch.cat(parts) if single[n].dim() >= 2 else parts[0]
    except (KeyError, RuntimeError, TypeError) as exc:
        return f"M = {M}: the ranks' weights put back together: cannot ({type(exc).__name__}): FAIL"
    bad = [n for n in single if params[n].shape != single[n].shape]
    if bad:
        return (
            f"M = {M}: the ranks' weights put back together: {bad[0]} has shape {list(params[bad[0]].shape)}, "
            f"expected {list(single[bad[0]].shape)}: FAIL"
        )
    return compare(
        f"M = {M}: the ranks' weights put back together vs one device after {SAVED_AT} steps",
        params,
        single,
    ).line


# ---- checkpoint_cost: a prediction


def _dp_save(root: str) -> int:
    """Rank code: plain DP with Adam after one step; rank 0 saves; returns the bytes of its pieces."""
    model = build_model(CFG)
    opt = make_optimizer(model.parameters(), "adam", LR)
    x, y = BATCHES[0]
    lm_loss(model(x), y).backward()
    opt.step()
    pieces = ckpt.dp_pieces(model, opt)
    ckpt.save(root, 1, pieces, layout="dp", extra={"optimizer_step": 1})
    return sum(p.data.numel() * p.data.element_size() for p in pieces)


def collect_checkpoint_cost(dp_bytes, tau_minutes, lost_percent) -> dict:
    root = tempfile.mkdtemp(prefix="parlab-lab11-")
    try:
        measured = parlab.launch(_dp_save, 1, root, **LAUNCH)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"predicted": [dp_bytes, tau_minutes, lost_percent], "measured": measured}


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
    psi = sum(p.numel() for p in build_model(CFG).parameters())
    dp_bytes, tau_minutes, lost_percent = data["predicted"]
    mtbf = DEVICE_MTBF_HOURS * 3600 / DEVICES
    tau = _best_interval(mtbf)
    lines = prediction_lines("bytes rank 0 writes (plain DP, Adam, float64)", dp_bytes, 3 * psi * 8, data["measured"])
    lines += prediction_lines("the interval that loses the least time (minutes)", tau_minutes, tau / 60)
    lines += prediction_lines(
        "percent of the time lost at that interval", lost_percent, 100 * _lost_fraction(tau, mtbf)
    )
    return lines
