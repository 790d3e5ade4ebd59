"""Lab 11's checks: surviving dead machines without changing the training, the tensor-parallel layout of the lab
model with its checkpoint writers chosen, the reshard of its checkpoint into other layouts on other numbers of
ranks, on live ranks, and the checkpoint interval on a simulated cluster (see parlab/grading).

    part 1  survive          relaunch as machines keep dying, every step on the whole global batch, each launch the
                             plan of least step time (rows per rank plus a fixed cost per micro-batch) on the
                             machines alive, from the last checkpoint; a rank's bug, a refused launch and the last
                             machine's death reach the caller. Six jobs: the lessons' GPT trained for real (ZeRO-1,
                             Adam, equal to one device on every row), five on a harness that plans without training
    part 2  tp_layout        the box of every lab-model tensor each of M tensor-parallel ranks holds, and whether it
                             writes it: attention cut by query heads, each rank with the K/V heads its queries read
                             (GQA: replicated when M exceeds the K/V heads), row-parallel matrices cut by columns;
                             every element written by exactly one rank, the writers of the shared boxes chosen so
                             that the busiest writer writes as little as any choice allows; a real save with them
    part 3  reshard          a tensor-parallel checkpoint of the lab model written by 4 ranks, loaded cut by
                             columns on 3 ranks and by rows on 3, each piece a box stored row-major: reading each
                             element of the box once, nothing else, in the fewest reads
    part 4  checkpoint_cost  the checkpoint interval and the fraction of time lost at it, with frequent failures and
                             asynchronous writes, judged on a simulated run (the least measured loss; the prediction)

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
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

import parlab
from parlab.core import comm
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model, lab_batches, lab_loss, train_lab_single_device
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches, make_optimizer, train_single_device
from parlab.grading.labs import run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.schemes.faults import checkpoint as ckpt
from parlab.schemes.faults.failures import KILLED_EXIT_CODE, FaultPlan, die
from parlab.schemes.zero.stages import ZeRO

LAUNCH = {"timeout": 60, "echo": False}
# Part 1's training job: the lessons' small GPT (float64, Psi = 7,744), ZeRO-1 with Adam, 6 steps of a global batch
# of 18 rows, on a job of 4 machines; a rank holds at most 2 rows at once (a micro-batch of at most 2 rows).
CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float64")
MACHINES, B, ROWS_AT_ONCE, STEPS, LR = 4, 18, 2, 6, 1e-3
EVERY = 2  # a checkpoint after every 2 completed steps
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T]
# Parts 2-3: the lab model (parlab.core.lab_model's defaults: V = 64, H = 32, 4 query heads and 2 K/V heads of 8,
# F = 64, 2 blocks, untied, float64). Part 3's checkpoint: a tensor-parallel one written by SAVED_TP ranks (the judge's
# cut and writers: each K/V head, held by two ranks, written by one; the gains by rank 0) after one Adam step on a
# batch of LAB_B rows, loaded in LOADS: every matrix cut by columns on 3 ranks, then by rows on 3 ranks (uneven
# bounds: 32 and 64 in 3). A loading box then takes some saved pieces' every column (one stretch of the piece's
# file) and others' only some (one stretch per row): q, k, v, gate, up, the embedding and the head are saved by rows,
# o and down by columns.
LAB = LabConfig()
SAVED_TP, SAVED_AT, LAB_B = 4, 3, 6
LAB_BATCHES = lab_batches(LAB, LAB_B, SAVED_AT, seed=0)
LOADS = (("cols", 3), ("rows", 3))
# tp_layout's cases: (query heads, K/V heads, M, blocks) of the lab model with H = 32 (V = F = 64): GQA with its K/V
# heads split and replicated, multi-head (nkv = nq) and multi-query (nkv = 1) attention, 1 to 3 blocks. Where the
# shared boxes are many (3 blocks), placing them in the model's order, smallest first or round-robin leaves a
# writer heavier than need be; so does torch.distributed.checkpoint's dedup (each item, in order, to the holder
# with the least planned so far).
LAYOUT_CASES = [(4, 2, 1, 1), (8, 4, 2, 1), (8, 8, 4, 1), (4, 2, 4, 2), (8, 2, 8, 1), (8, 2, 8, 3), (4, 1, 4, 3)]
SAVE_M = 4  # the real save: the lab model itself (case (4, 2, 4, 2)) on 4 ranks, with the student's writers
# checkpoint_cost's clusters: (the job's MTBF, the pause, the background write, the restart), seconds. Failures are
# frequent enough that a first-order count of the loss misses by more than LOSS_RTOL on every one, and
# the write long enough that taking it for a cost per checkpoint misses the best interval by more than SIM_SLACK on
# all but the last. The simulated run: SIM_FAILURES failures drawn with SIM_SEED, the same for every interval.
CLUSTERS = [(7200, 30, 600, 120), (1800, 60, 120, 300), (600, 30, 60, 60), (900, 120, 30, 120)]
SIM_SEED, SIM_FAILURES, SIM_SLACK, LOSS_RTOL = 11, 200_000, 0.01, 0.02
ADAM = ("exp_avg", "exp_avg_sq")  # the checkpoint's names of Adam's m and v: optim.<parameter>.exp_avg, ...

# parlab's own code for what the parts ask (parlab/grading/labs/guard.py): checkpoints, failures, their runs and
# lesson helpers, and the tensor-parallel layout of the lessons' GPT.
LIBRARY = ("schemes/faults/", "runs/checkpoint.py", "lessons/fault_tolerance.py", "schemes/tensor_parallel.py")

STRUCTURAL = {
    "survive": "six jobs, each launch judged against the machines alive then: all of the global batch's rows taken "
    "(a plan that leaves rows out fails), micro-batches equal and within the rows a rank holds at once, the fewest "
    "such micro-batches, and the least step time (rows per rank + micro-batches x the fixed cost) of any plan on "
    "the machines alive (any plan of that least time passes; a FAIL names the launch, what came and why it is "
    "wrong: too many micro-batches, a dearer number of ranks, rows left out, a refusal), the first launch from step "
    "0 and every relaunch resuming; job 1 trains the lessons' GPT for real (ZeRO-1, Adam, 4 machines, 18 rows, 2 at "
    "once, two machines die in turn): resumed from the step-4 checkpoint and the final parameters equal to one "
    "device on all 18 rows of every step; jobs 2 and 3 (8 machines, 40 rows, 4 at once, a micro-batch costing 2 "
    "and 0.5 rows) only plan: the fixed cost decides between more ranks and fewer micro-batches, each way once, "
    "and a rule of thumb (the most ranks; micro-batches of the most rows when they divide, else of one row) fails; "
    "job 4: a rank's code raises (a bug, no machine died): its RankError reaches the caller after 1 launch; job 5: "
    "every machine dies: the last RankError reaches the caller; job 6: a launch fails before any rank starts "
    "(ValueError): it reaches the caller after 1 launch; a survive() that keeps relaunching is stopped after 8 "
    "launches; no call into parlab's fault-tolerance code",
    "tp_layout": "for the lab model's every tensor on M tensor-parallel ranks (GQA with K/V heads split, replicated "
    "when M exceeds them, multi-head and multi-query attention; M = 1 to 8; 1 to 3 blocks): each rank's box (rows, "
    "columns) equals Megatron's cut by query heads, K/V heads, F and vocabulary rows; of the ranks holding the same "
    "box exactly one writes it; the rank that writes the most elements writes no more than under the best choice "
    "of writers (the judge's exhaustive search; a FAIL names the busiest rank and its elements, not the best); the "
    "first wrong box or writer shown with expected and received; then a real tensor-parallel save of the lab model "
    "on 4 ranks with your boxes and writers: every element of every tensor (weights, Adam m and v) in exactly one "
    "rank's file, and the bytes the busiest rank wrote measured; no call into parlab's code",
    "reshard": "a tensor-parallel checkpoint of the lab model written by 4 ranks (part 2's cut, each box by one of "
    "its holders), loaded cut by columns on 3 ranks and by rows on 3 ranks: every rank's part of every "
    "tensor (weights, Adam m and v) equals the checkpoint's exactly, with the box's shape; the elements your code "
    "read (each read a range of one saved piece as its file stores it) are exactly the box's, each once, the bytes "
    "read shown beside the boxes' (reading whole pieces, or a range that spans columns the box lacks, fails); no "
    "two reads that one read could make (reading a piece's whole-width overlap row by row fails; a FAIL names the "
    "two reads, not the fewest count); the row layout's weights put back together equal one device; no call into "
    "parlab's checkpoint code",
    "checkpoint_cost": "four clusters (MTBF 10 min to 2 h, frequent failures, an asynchronous write): the job run "
    "on a simulated cluster (200,000 seeded failures, the same for every interval): your interval loses at most 1% "
    "more (relatively) than the least any interval of a fine search loses, and your predicted fraction lost is "
    "within 2% of the fraction measured at your interval (the write priced as a cost per checkpoint fails the "
    "first, a first-order count of the loss the second); no call into parlab's fault-tolerance code",
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


# ---- survive: catch the failure, relaunch on the machines left, the same global batch at the least step time


@dataclass(frozen=True)
class Job:
    """One job survive() is given, and what happens to its launches (numbered as they start: a refused launch
    starts nothing). deaths: {launch: (rank, step)}: that rank's machine dies in that launch (in the middle of that
    1-based step when the job trains; a plan-only job has every relaunch resume from a checkpoint). bug: the first
    launch in which a rank's code raises, as it does in every later one (no machine dies). bad_argument: every
    launch fails before any rank starts. real: the job trains the lessons' GPT on live ranks; else the harness only
    plans (it starts nothing)."""

    what: str
    machines: int
    batch: int
    rows_at_once: int
    micro_cost: float  # the fixed cost of one micro-batch, in the time a rank takes for one row
    deaths: dict = field(default_factory=dict)
    bug: int = 0
    bad_argument: bool = False
    real: bool = False

    def said(self) -> str:
        rows = f"{self.batch} rows a step, {self.rows_at_once} at once"
        return f"{self.machines} machines, {rows}, c = {self.micro_cost:g}; {self.what}"


# Job 1 trains: each relaunch resumes from step 4, the second launch loses a rank in step 6, after which no newer
# checkpoint exists (none is taken after the last step). Jobs 2 and 3 differ only in the micro-batch's cost: with 2
# rows' time 5 ranks of 8 rows in 2 micro-batches beat 8 ranks of 5 rows in 5; with half a row's, 8 ranks win.
JOBS = [
    Job(
        "two machines die in turn; it trains for real",
        MACHINES,
        B,
        ROWS_AT_ONCE,
        1,
        deaths={1: (2, 5), 2: (1, 6)},
        real=True,
    ),
    Job("four machines die in turn", 8, 40, 4, 2, deaths={k: (1, 0) for k in (1, 2, 3, 4)}),
    Job("one machine dies", 8, 40, 4, 0.5, deaths={1: (1, 0)}),
    Job("a rank's code raises in every launch (a bug; no machine dies)", 4, 8, 2, 1, bug=1),
    Job("every machine dies", 2, 4, 2, 1, deaths={1: (1, 0), 2: (0, 0)}),
    Job("a launch fails before any rank starts (a bad argument)", MACHINES, B, ROWS_AT_ONCE, 1, bad_argument=True),
]
MAX_LAUNCHES = 8  # a survive() that relaunches more often than this is stopped by the check (it would never end)
# What parlab.launch's RankError holds for a rank whose process died (parlab/runtime/hang.py): no Python traceback.
DIED = f"the process exited with code {KILLED_EXIT_CODE} before returning a result"


class TooManyLaunches(BaseException):
    """The check stops a survive() that keeps relaunching (a BaseException: `except Exception` does not catch it)."""


def _rank_code_raises() -> None:
    """What a bug in rank code looks like: a shape error in a matrix product."""
    x, w = torch.zeros(2, 16), torch.zeros(32, 16)  # host: only its error is wanted
    x @ w  # [2, 16] @ [32, 16]: raises


def a_bug() -> str:
    """The traceback a rank whose code raised sends back (parlab.launch's RankError carries it)."""
    try:
        _rank_code_raises()
    except RuntimeError:
        return traceback.format_exc()
    raise AssertionError("the bug did not raise")


def elastic_rank(plan: FaultPlan, rows: int, micro_batches: int) -> dict:
    """Rank code of job 1's launch_run: ZeRO-1 with Adam on the lessons' GPT. Rank r takes rows [r rows,
    (r+1) rows) of every global batch [B, T], in `micro_batches` equal micro-batches whose gradients it accumulates
    (each scaled by 1/micro_batches, so that the step averages over all P * rows rows); a checkpoint after every
    EVERY steps (parlab's sharded writer); resumed from the newest complete one; plan.kill_rank dies in the middle
    of step plan.at_step. Returns the step it started from and the final parameters (whole)."""
    rank = comm.group_rank()
    # ZeRO-1: each .grad a view of its unit's flat gradient, so the micro-batches' backwards add up in place, and the
    # step reduce-scatters the sum once
    zero = ZeRO(build_model(CFG, 0, device=parlab.device()), 1, lr=LR)
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


def _whole_ints(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def refusal(job: Job, world_size, rows, micro_batches, alive: int) -> str:
    """Why the harness refuses a launch before any rank starts ('' when it does not)."""
    if not _whole_ints(world_size, rows, micro_batches):
        return f"world_size, rows and micro_batches must be positive ints: {world_size!r}, {rows!r}, {micro_batches!r}"
    if world_size > alive:
        return f"{world_size} ranks, but only {alive} machines are alive"
    if world_size * rows > job.batch:
        return f"{world_size} ranks x {rows} rows = {world_size * rows} rows, but a global batch has {job.batch}"
    if rows % micro_batches:
        return f"{rows} rows do not cut into {micro_batches} equal micro-batches"
    if rows // micro_batches > job.rows_at_once:
        return f"a micro-batch of {rows // micro_batches} rows does not fit a rank's memory ({job.rows_at_once} rows)"
    return ""


def fewest_micro_batches(rows: int, rows_at_once: int) -> int:
    """The fewest equal micro-batches that cut `rows` rows into parts of at most `rows_at_once`."""
    return min(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= rows_at_once)


def step_cost(job: Job, rows: int, micro_batches: int) -> float:
    """A step's time, in the time a rank takes for one row: its rows, plus the fixed cost of each micro-batch."""
    return rows + micro_batches * job.micro_cost


def least_step_cost(job: Job, alive: int) -> float:
    """The judge's own plan: the least step time of any launch on at most `alive` machines that takes the whole
    batch (every rank the same rows, in the fewest micro-batches that fit)."""
    return min(
        step_cost(job, job.batch // w, fewest_micro_batches(job.batch // w, job.rows_at_once))
        for w in range(1, alive + 1)
        if job.batch % w == 0
    )


def _plain(value):
    """A number (or a prediction) as plain data for the grader: a number stays a number; anything else its text."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return value if isinstance(value, (int, float)) else repr(value)[:80]


def run_job(survive, job: Job) -> dict:
    """survive() on one job: the launches it made ([world, resume, rows, micro-batches], in order), how it ended
    (returned / raised / stopped) and whether what reached the caller is what the last launch gave (its results, or
    the very error it raised); for the real job, the finished run's start step and parameters."""
    root, calls, started, called = tempfile.mkdtemp(prefix="parlab-lab11-"), [], [], []
    last = {"given": None}
    alive = [job.machines]

    def launch_run(world_size, resume, rows, micro_batches):
        """Train on `world_size` ranks, each taking `rows` rows of every global batch in `micro_batches` equal
        micro-batches (resume: from the newest complete checkpoint). Returns the ranks' results."""
        calls.append([_plain(world_size), bool(resume), _plain(rows), _plain(micro_batches)])
        if len(calls) > MAX_LAUNCHES:
            raise TooManyLaunches(f"stopped by the check after {MAX_LAUNCHES} launches")
        if job.bad_argument:
            last["given"] = ValueError("a bad argument, found before any rank started")
            raise last["given"]
        why = refusal(job, world_size, rows, micro_batches, alive[0])
        if why:
            last["given"] = ValueError(f"launch refused: {why}")
            raise last["given"]
        started.append(len(started) + 1)
        rank, step = job.deaths.get(started[-1], (None, 0))
        if job.real:
            with outside_the_guard():
                plan = FaultPlan(root, every=EVERY, kill_rank=rank, at_step=step, resume=bool(resume))
                try:
                    last["given"] = parlab.launch(elastic_rank, world_size, plan, rows, micro_batches, **LAUNCH)
                except parlab.RankError as exc:
                    if rank is None:
                        last["given"] = exc
                        raise
                    alive[0] -= 1  # one machine fewer; the error as parlab.launch names a process that died
                    last["given"] = parlab.RankError(rank, DIED)
                    raise last["given"] from exc
                return last["given"]
        if rank is not None:
            alive[0] -= 1
            last["given"] = parlab.RankError(min(rank, world_size - 1), DIED)
        elif job.bug and started[-1] >= job.bug:  # a bug raises again in every launch after it
            last["given"] = parlab.RankError(world_size - 1, a_bug())
        else:
            last["given"] = [{"rank": r} for r in range(world_size)]  # what the ranks would return
            return last["given"]
        raise last["given"]

    data = {"calls": calls}
    try:
        with library_calls(LIBRARY) as called:
            results = survive(launch_run, job.machines, job.batch, job.rows_at_once, job.micro_cost)
        data.update(ended="returned", same=results is last["given"] and last["given"] is not None)
        if job.real and data["same"]:
            data.update(start=results[0]["start"], params=results[0]["params"])
    except (Exception, TooManyLaunches) as exc:  # an error let through to the caller, or no end
        if isinstance(exc, TooManyLaunches):
            data.update(ended=f"stopped ({exc})", same=False)
        else:
            first = (str(exc).splitlines() or [""])[0][:100]  # a RankError's text goes on with the traceback
            data.update(ended=f"raised {type(exc).__name__}: {first}", same=exc is last["given"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    data["library"] = list(called)
    return data


def collect_survive(survive) -> dict:
    jobs = [run_job(survive, job) for job in JOBS]
    return {"jobs": jobs, "library": [c for job in jobs for c in job.pop("library")]}


def _plan_problem(job: Job, calls: list) -> str | None:
    """What is wrong with the first launch that is not a plan of least step time on the machines alive, taking the
    whole batch, resuming exactly when it relaunches (None: nothing). Only the launches the job should make are
    judged here: a launch more is the ending's verdict."""
    alive, started = job.machines, 0
    for k, (world, resume, rows, micro) in enumerate(calls[: _ending(job)[0]], 1):
        said = f"launch {k}, {alive} machines alive: {world} ranks x {rows} rows in {micro} micro-batches"
        why = "" if job.bad_argument else refusal(job, world, rows, micro, alive)
        if why:
            return f"{said}: refused ({why})"
        if job.bad_argument and not _whole_ints(world, rows, micro):
            return f"{said}: not positive whole numbers"
        if world * rows < job.batch:
            return f"{said}: {world * rows} of the {job.batch} rows a step has; the others are left out"
        if micro > fewest_micro_batches(rows, job.rows_at_once):
            return (
                f"{said}: micro-batches of {rows // micro} rows where a rank holds {job.rows_at_once} at once: fewer "
                "equal micro-batches would do"
            )
        cost = step_cost(job, rows, micro)
        if cost > least_step_cost(job, alive) + 1e-9:
            return f"{said}: a step costs {cost:g} rows' time; another number of ranks on {alive} machines costs less"
        if k == 1 and resume:
            return f"{said}, resuming: nothing of this job was saved yet"
        if k > 1 and not resume:
            return f"{said}, from step 0 after a death: the steps the last checkpoint holds are done again"
        if not job.bad_argument:
            started += 1
            alive -= started in job.deaths
    return None


def _ending(job: Job) -> tuple[int, str, str]:
    """(launches, how survive must end, the ending's word in the data) for a job."""
    if job.bad_argument:
        return 1, "the ValueError reached the caller", "raised ValueError"
    if job.bug:
        return job.bug, "the rank's error (a RankError with its traceback) reached the caller", "raised RankError"
    if len(job.deaths) >= job.machines:
        return len(job.deaths), "the last death's RankError reached the caller", "raised RankError"
    return len(job.deaths) + 1, "the finished launch's results returned", "returned"


def judge_survive(data) -> list[str]:
    lines = [_library_line("survive", data["library"])]
    for i, (job, got) in enumerate(zip(JOBS, data["jobs"], strict=True), 1):
        calls = [tuple(c) for c in got["calls"]]
        problem = _plan_problem(job, calls)
        what = f"job {i} ({job.said()})"
        plans = "every launch a plan of least step time on the machines alive, resuming after a death"
        lines.append(f"{what}: {plans}: PASS" if problem is None else f"{what}: {problem}: FAIL")
        launches, how, word = _ending(job)
        ok = len(calls) == launches and got["ended"].startswith(word) and got["same"]
        received = (
            got["ended"] if got["same"] or not got["ended"].startswith(word) else f"{got['ended']} (not the one given)"
        )
        expected = f"after {launches} launch(es), {how}"
        lines.append(
            f"job {i}: {expected}: PASS"
            if ok
            else f"job {i}: expected: {expected}; received: {len(calls)} launch(es), {received}: FAIL"
        )
        if job.real and ok:
            start = got["start"]
            lines.append(
                f"job {i}: resumed from step {start} (the last checkpoint: 4): {'PASS' if start == 4 else 'FAIL'}"
            )
            lines.append(
                compare(
                    f"job {i}: final parameters vs one device on all {B} rows of every step",
                    got["params"],
                    single_device(),
                ).line
            )
    return lines


# ---- tp_layout: the lab model's tensor-parallel layout, GQA included, and who writes each box


def layout_config(heads: int, kv_heads: int, layers: int) -> LabConfig:
    """tp_layout's models: the lab model with H = 32, V = F = 64 and the given attention heads and blocks."""
    return LabConfig(hidden=32, heads=heads, kv_heads=kv_heads, layers=layers)


assert layout_config(4, 2, 2) == LAB  # the case saved for real is the lab model itself


def tp_box(name: str, shape: list[int], cfg: LabConfig, M: int, r: int) -> tuple[tuple, bool]:
    """The judge's own layout: rank r of M's box of the lab-model tensor `name` ((start, stop) per dimension) and
    whether r writes it in the checks' own checkpoints (the first rank holding that box; the student chooses).

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


def _elements(box) -> int:
    return math.prod(b - a for a, b in box)


def writer_plan(cfg: LabConfig, M: int) -> tuple[dict[str, dict[tuple, int]], int]:
    """Who writes each box of a tensor-parallel checkpoint on M ranks ({tensor: {box: rank}}) so that the busiest
    rank writes the fewest elements (of the weights; m and v follow them), and that number. A box one rank holds is
    its own; a box several hold goes to one of them: an exhaustive search over those, largest first, pruned by the
    best found so far (the judge's optimum; it assumes nothing about which rule reaches it)."""
    plan: dict[str, dict[tuple, int]] = {}
    load, shared = [0] * M, []  # elements each rank must write; (elements, tensor, box, holders) of shared boxes
    for name, p in build_lab_model(cfg).named_parameters():
        holders: dict[tuple, list[int]] = {}
        for r in range(M):
            holders.setdefault(tp_box(name, list(p.shape), cfg, M, r)[0], []).append(r)
        plan[name] = {}
        for box, ranks in holders.items():
            if len(ranks) == 1:
                plan[name][box] = ranks[0]
                load[ranks[0]] += _elements(box)
            else:
                shared.append((_elements(box), name, box, ranks))
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


def _case_key(case: tuple, r: int, name: str) -> str:
    return "/".join(str(v) for v in (*case, r, name))


def tp_save_rank(root: str, writes: dict[int, dict[str, tuple]]) -> int:
    """Rank code: the lab model after one Adam step on one device's whole batch, saved as a tensor-parallel
    checkpoint (parlab's writer: each rank the boxes `writes[rank]` gives it, each with its m and v; rank 0 the
    metadata); the bytes this rank wrote."""
    r = comm.group_rank()
    model = build_lab_model(LAB, seed=0, device=parlab.device())
    opt = make_optimizer(model.parameters(), "adam", LR)
    x, y = (t.to(parlab.device()) for t in LAB_BATCHES[0])
    lab_loss(model(x), y).backward()
    opt.step()
    pieces = []
    for name, p in model.named_parameters():
        if name not in writes[r]:
            continue
        box = writes[r][name]
        cut, starts = tuple(slice(a, b) for a, b in box), tuple(a for a, _ in box)
        for key, tensor in [("model", p), *((k, opt.state[p][k]) for k in ADAM)]:
            label = f"model.{name}" if key == "model" else f"optim.{name}.{key}"
            pieces.append(ckpt.Piece(label, tensor.detach()[cut].clone(), tuple(p.shape), offsets=starts))
    ckpt.save(root, 1, pieces, layout="tp", extra={"optimizer_step": 1})
    return sum(piece.data.numel() * piece.data.element_size() for piece in pieces)


def _save_with(answers: dict) -> dict:
    """A real tensor-parallel save of the lab model on SAVE_M ranks, each rank writing the boxes the answer says it
    writes: the pieces the checkpoint's metadata lists ({tensor: [[rank, offsets, lengths], ...]}) and the bytes each
    rank wrote."""
    case = next(c for c in LAYOUT_CASES if layout_config(*c[:2], c[3]) == LAB and c[2] == SAVE_M)
    writes: dict[int, dict[str, tuple]] = {r: {} for r in range(SAVE_M)}
    for name, _ in build_lab_model(LAB).named_parameters():
        for r in range(SAVE_M):
            answer = answers[_case_key(case, r, name)]
            if not isinstance(answer, str) and answer[1]:
                writes[r][name] = answer[0]
    root = tempfile.mkdtemp(prefix="parlab-lab11-")
    try:
        written = parlab.launch(tp_save_rank, SAVE_M, root, writes, **LAUNCH)
        meta = json.loads((ckpt.latest(root) / "metadata.json").read_text())
    except (parlab.RankError, ValueError, TypeError) as exc:  # boxes a rank cannot cut: the save fails, judged so
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pieces = {n: [[p["rank"], p["offsets"], p["lengths"]] for p in e["pieces"]] for n, e in meta["tensors"].items()}
    return {"bytes": list(written), "pieces": pieces}


def collect_tp_layout(tp_layout) -> dict:
    answers = {}
    with library_calls(LIBRARY) as called:
        for case in LAYOUT_CASES:
            heads, kv_heads, M, layers = case
            cfg = layout_config(heads, kv_heads, layers)
            for name, p in build_lab_model(cfg).named_parameters():
                for r in range(M):
                    try:
                        answers[_case_key(case, r, name)] = _as_layout(tp_layout(name, list(p.shape), cfg, M, r))
                    except Exception as exc:  # one case breaks: it fails, the others are judged
                        answers[_case_key(case, r, name)] = f"raised {type(exc).__name__}: {str(exc)[:80]}"
    return {"answers": answers, "library": list(called), "saved": _save_with(answers)}


def _box_said(box) -> str:
    if len(box) == 1:
        return f"elements [{box[0][0]}, {box[0][1]})"
    return " x ".join(f"{what} [{a}, {b})" for what, (a, b) in zip(("rows", "columns"), box, strict=True))


def _case_problem(data, case: tuple) -> str | None:
    """The first wrong box or writer of one case, else the busiest writer when a better choice exists (None: all
    right)."""
    heads, kv_heads, M, layers = case
    cfg = layout_config(heads, kv_heads, layers)
    load = [0] * M  # elements each rank writes
    for name, p in build_lab_model(cfg).named_parameters():
        holders: dict[tuple, list[int]] = {}  # box -> the ranks that hold it
        answers = {r: data["answers"][_case_key(case, r, name)] for r in range(M)}
        for r in range(M):
            want, _ = tp_box(name, list(p.shape), cfg, M, r)
            holders.setdefault(want, []).append(r)
            got = answers[r] if isinstance(answers[r], str) else tuple(tuple(d) for d in answers[r][0])
            if got != want:
                said = got if isinstance(got, str) else _box_said(got)
                return f"rank {r}, {name} {list(p.shape)}: expected {_box_said(want)}; received {said}"
        for box, ranks in holders.items():
            writers = [r for r in ranks if answers[r][1]]
            if len(writers) != 1:
                return (
                    f"{name} {list(p.shape)}: {_box_said(box)} is held by ranks {ranks}, written by "
                    f"{writers or 'none of them'} (expected: exactly one of them)"
                )
            load[writers[0]] += _elements(box)
    if max(load) > writer_plan(cfg, M)[1]:
        busiest = load.index(max(load))
        return (
            f"rank {busiest} writes the most, {max(load):,} elements (of the weights; their m and v follow): other "
            "writers of the shared boxes let every rank write fewer"
        )
    return None


def _saved_lines(saved: dict) -> list[str]:
    """The real save: every element of every tensor in exactly one rank's file; the busiest rank's bytes, measured."""
    what = f"a real save of the lab model on M = {SAVE_M} with your boxes and writers"
    if "error" in saved:
        return [f"{what}: the save failed ({saved['error']}): FAIL"]
    problem = None
    for name, p in build_lab_model(LAB).named_parameters():
        for label in (f"model.{name}", *(f"optim.{name}.{k}" for k in ADAM)):
            count = torch.zeros(p.shape, dtype=torch.int64)  # host: the judge's bookkeeping
            for _, offsets, lengths in saved["pieces"].get(label, []):
                if len(offsets) == p.dim():
                    count[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))] += 1
            if problem is None and bool((count != 1).any()):
                where = tuple(int(i) for i in (count != 1).nonzero()[0])
                problem = f"{label}: element {where} is in {int(count[where])} ranks' files"
    lines = [
        f"{what}: every element of every tensor (weights, Adam m and v) in exactly one rank's file: PASS"
        if problem is None
        else f"{what}: first wrong: {problem}: FAIL"
    ]
    written, best = saved["bytes"], 3 * LAB.dtype_bytes * writer_plan(LAB, SAVE_M)[1]
    busiest = written.index(max(written))
    lines.append(f"{what}: bytes each rank wrote: {', '.join(f'{b:,}' for b in written)}")
    lines.append(
        f"{what}: the busiest rank wrote {max(written):,} bytes, as few as any choice of writers allows: PASS"
        if max(written) <= best
        else f"{what}: rank {busiest} wrote {max(written):,} bytes, and other writers let every rank write fewer: FAIL"
    )
    return lines


def judge_tp_layout(data) -> list[str]:
    lines = [_library_line("tp_layout", data["library"])]
    for case in LAYOUT_CASES:
        heads, kv_heads, M, layers = case
        what = f"nq = {heads}, nkv = {kv_heads}, {layers} block(s) on M = {M}"
        problem = _case_problem(data, case)
        lines.append(
            f"{what}: every rank's box of every tensor, each written once, the busiest writer as light as any choice "
            "allows: PASS"
            if problem is None
            else f"{what}: first wrong: {problem}: FAIL"
        )
    return lines + _saved_lines(data["saved"])


# ---- reshard: a tensor-parallel checkpoint of the lab model into another layout on another number of ranks


def target_box(layout: str, name: str, shape: list[int], M: int, r: int) -> tuple:
    """Rank r of M's box of the checkpoint tensor `name` in a loading layout, cut as evenly as M allows (rank r
    takes [r n // M, (r+1) n // M) of n): "rows" (a matrix by rows, every column) or "cols" (a matrix by columns,
    every row); a vector is cut as one range in both."""
    n = shape[-1] if layout == "cols" else shape[0]
    part = (r * n // M, (r + 1) * n // M)
    if len(shape) == 1:
        return (part,)
    return ((0, shape[0]), part) if layout == "cols" else (part, (0, shape[1]))


def param_name(name: str) -> str:
    """The lab-model parameter a checkpoint tensor belongs to: model.X -> X, optim.X.exp_avg -> X."""
    name = name.removeprefix("model.").removeprefix("optim.")
    return name.rsplit(".", 1)[0] if name.endswith(ADAM) else name


def _piece_box(piece: dict) -> tuple:
    """A saved piece's box ((start, stop) per dimension) from parlab's metadata (offsets, lengths)."""
    return tuple((o, o + n) for o, n in zip(piece["offsets"], piece["lengths"], strict=True))


def load_rank(reshard, root: str, layout: str, library: tuple) -> dict:
    """Rank code: rank r of M loads its box (`layout`) of every saved tensor with the student's reshard; the reads
    it made ({tensor: [(q, start, stop), ...]}, in order: ranges of rank q's piece, flattened row-major)."""
    M, r = comm.group_size(), comm.group_rank()
    folder = Path(root)
    meta = json.loads((folder / "metadata.json").read_text())
    files, reads, held = {}, {}, {}

    def read(name: str, sizes: dict, q, start, stop) -> torch.Tensor:
        """Elements [start, stop) of rank q's piece of tensor `name`, the piece flattened row-major."""
        with outside_the_guard():
            if q not in sizes:
                raise ValueError(f"{name}: rank {q!r} saved no piece of it (pieces: ranks {sorted(sizes)})")
            whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop))
            if not whole or not 0 <= start < stop <= sizes[q]:
                raise ValueError(
                    f"{name}: read({q}, {start!r}, {stop!r}) is not a range of rank {q}'s piece of {sizes[q]} elements"
                )
            reads.setdefault(name, []).append((int(q), int(start), int(stop)))
            if q not in files:  # memory-mapped: only the bytes asked for are read
                files[q] = torch.load(folder / f"rank{int(q)}.pt", mmap=True, weights_only=True)
            return files[q][name].reshape(-1)[start:stop].clone()  # host: [stop - start] from the file, as a loader

    with library_calls(library) as called:
        for name, entry in meta["tensors"].items():
            shape = list(entry["shape"])
            box = target_box(layout, name, shape, M, r)
            pieces = [{"rank": p["rank"], "box": _piece_box(p)} for p in entry["pieces"]]
            sizes = {p["rank"]: math.prod(p["lengths"]) for p in entry["pieces"]}
            held[name] = reshard(pieces, shape, box, lambda q, a, b, n=name, s=sizes: read(n, s, q, a, b))
    return {"held": held, "reads": reads, "library": list(called)}


def collect_reshard(reshard) -> dict:
    """The lab model saved by SAVED_TP tensor-parallel ranks (the judge's cut and writers), loaded in each of
    LOADS."""
    root = tempfile.mkdtemp(prefix="parlab-lab11-")
    try:
        shapes = {n: list(p.shape) for n, p in build_lab_model(LAB).named_parameters()}
        writes = {r: {} for r in range(SAVED_TP)}
        for n, shape in shapes.items():
            for r in range(SAVED_TP):
                box, writer = tp_box(n, shape, LAB, SAVED_TP, r)
                if writer:
                    writes[r][n] = box
        parlab.launch(tp_save_rank, SAVED_TP, root, writes, **LAUNCH)
        folder = ckpt.latest(root)
        reader = ckpt.Reader(folder)
        full = {n: reader.full(n) for n in reader.names()}
        meta = {n: [[p["rank"], _piece_box(p)] for p in e["pieces"]] for n, e in reader.meta["tensors"].items()}
        loads = {
            f"{layout}/{M}": [
                dict(v) for v in parlab.launch(load_rank, M, reshard, str(folder), layout, LIBRARY, **LAUNCH)
            ]
            for layout, M in LOADS
        }
        return {"full": full, "meta": meta, "loads": loads}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _to_global(shape: list[int], pbox: tuple, start: int, stop: int) -> list[int]:
    """The flat (row-major) indices in the whole tensor of elements [start, stop) of a piece with box pbox."""
    width = pbox[1][1] - pbox[1][0] if len(pbox) == 2 else 1
    C = shape[1] if len(shape) == 2 else 1
    out = []
    for i in range(start, stop):
        row, col = divmod(i, width)
        out.append((pbox[0][0] + row) * C + (pbox[1][0] + col if len(pbox) == 2 else 0))
    return out


def _box_elements(shape: list[int], box: tuple) -> list[int]:
    """The flat (row-major) indices of a box's elements, in order."""
    index = torch.arange(math.prod(shape), device="cpu").view(shape)  # host: the judge's bookkeeping
    return index[tuple(slice(a, b) for a, b in box)].reshape(-1).tolist()


def fewest_reads(shape: list[int], box: tuple, pieces: list) -> int:
    """The fewest reads that take exactly the box's elements, each read a range of one piece's own (row-major)
    elements: per piece, the runs of consecutive piece elements that lie in the box."""
    needed, count = set(_box_elements(shape, box)), 0
    for _, pbox in pieces:
        size = _elements(pbox)
        inside = [g in needed for g in _to_global(shape, pbox, 0, size)]
        count += sum(1 for i in range(size) if inside[i] and (i == 0 or not inside[i - 1]))
    return count


def _badly_read(shape: list[int], needed: list[int], pieces: dict, reads: list) -> str | None:
    """What is wrong with the elements a rank read of one tensor (None: each element of its box exactly once)."""
    box, count = set(needed), {}
    for q, a, b in reads:
        elements = _to_global(shape, pieces[q], a, b)
        outside = next((e for e in elements if e not in box), None)
        if outside is not None:
            return f"read [{a}, {b}) of rank {q}'s piece holds element {outside} of the tensor, outside the box"
        for e in elements:
            count[e] = count.get(e, 0) + 1
    twice = next((e for e in needed if count.get(e, 0) > 1), None)
    if twice is not None:
        return f"element {twice} read {count[twice]} times"
    missing = [e for e in needed if e not in count]
    return f"{len(missing)} elements of the box never read (the first: {missing[0]})" if missing else None


def _one_read_could_do(reads: list) -> str:
    """Two reads that one read could make: consecutive ranges of the same piece (reads that take each element of
    the box once and nothing else are more than the fewest exactly when two of them are)."""
    ends = {(q, b): (a, b) for q, a, b in reads}
    for q, a, b in reads:
        if (q, a) in ends:
            a0, b0 = ends[q, a]
            return f"reads [{a0}, {b0}) and [{a}, {b}) of rank {q}'s piece are one range of it: one read takes both"
    return f"{len(reads)} reads, some of elements outside the box or read twice"


def _load_said(key: str) -> str:
    layout, M = key.split("/")
    return f"{'columns' if layout == 'cols' else 'rows'} on M = {M}"


def judge_reshard(data) -> list[str]:
    full, meta = data["full"], data["meta"]
    called = [c for ranks in data["loads"].values() for d in ranks for c in d["library"]]
    lines = [_library_line("reshard", called)]
    for key, ranks in data["loads"].items():
        layout, M = key.split("/")[0], int(key.split("/")[1])
        wrong, badly_read, too_many, read_bytes, box_bytes = None, None, None, 0, 0
        for r, d in enumerate(ranks):
            for name, whole in full.items():
                shape = list(whole.shape)
                box = target_box(layout, name, shape, M, r)
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
                pieces = {q: tuple(tuple(x) for x in pbox) for q, pbox in meta[name]}
                reads = [tuple(x) for x in d["reads"].get(name, [])]
                read_bytes += sum(b - a for _, a, b in reads) * whole.element_size()
                box_bytes += want.numel() * whole.element_size()
                why = _badly_read(shape, _box_elements(shape, box), pieces, reads)
                if why is not None and badly_read is None:
                    badly_read = f"rank {r} {name}, box {_box_said(box)}: {why}"
                if why is None and too_many is None and len(reads) > fewest_reads(shape, box, list(pieces.items())):
                    too_many = f"rank {r} {name}, box {_box_said(box)}: {_one_read_could_do(reads)}"
        said = _load_said(key)
        lines.append(
            f"{said}: every rank's box of every tensor (weights, Adam m and v) equals the checkpoint's: PASS"
            if wrong is None
            else f"{said}: every rank's box of every tensor (weights, Adam m and v): first wrong: {wrong}: FAIL"
        )
        what = f"{said}: each rank read every element of its boxes once and no other"
        lines.append(
            f"{what} ({read_bytes:,} bytes read, the boxes' {box_bytes:,}): PASS"
            if badly_read is None
            else f"{what}: first wrong: {badly_read}: FAIL"
        )
        what = f"{said}: each rank read its boxes in the fewest reads the saved pieces allow"
        lines.append(f"{what}: PASS" if too_many is None else f"{what}: first wrong: {too_many}: FAIL")
    lines.append(_put_together(data))
    return lines


def _put_together(data) -> str:
    """The weights of the row layout's ranks, stacked by rows, against one device after the saved Adam step."""
    layout, M = next((lay, M) for lay, M in LOADS if lay == "rows")
    ranks = data["loads"][f"{layout}/{M}"]
    single = train_lab_single_device(LAB, LAB_BATCHES[:1], 0, "adam", LR).params
    try:
        params = {n: torch.cat([d["held"][f"model.{n}"] for d in ranks]) for n in single}
    except (KeyError, RuntimeError, TypeError) as exc:
        why = f"{type(exc).__name__}: {str(exc)[:80]}"
        return f"rows on M = {M}: the ranks' weights put back together: cannot ({why}): FAIL"
    return compare(f"rows on M = {M}: the ranks' weights put back together vs one device", params, single).line


# ---- checkpoint_cost: the interval, chosen by the student, measured on a simulated cluster


def simulate(mtbf: float, pause: float, write: float, restart: float, taus: torch.Tensor) -> torch.Tensor:
    """The fraction of wall time lost at each checkpoint interval in `taus` [K], measured on one simulated run of
    SIM_FAILURES failures (the same draws for every interval): the job runs X ~ Exp(mtbf) seconds between the end of
    a restart and the next failure; in that stretch it computes tau - pause, pauses (the checkpoint holds the state
    at the pause's start), computes on while the write takes `write`, ... ; the failure keeps the work of the last
    checkpoint complete by then (k of them: k tau + write <= X), loses the rest, and the restart takes `restart`
    seconds (no failure during it). Lost: 1 - the work kept / the wall time."""
    gen = torch.Generator(device="cpu").manual_seed(SIM_SEED)
    x = torch.empty(SIM_FAILURES, dtype=torch.float64).exponential_(1.0, generator=gen) * mtbf  # host: the judge's
    wall = x.sum() + restart * SIM_FAILURES
    lost = []
    for tau in taus.to(torch.float64).view(-1).split(16):  # 16 intervals at a time: [16, F] in memory
        tau = tau.view(-1, 1)
        kept = torch.clamp(torch.floor((x.view(1, -1) - write) / tau), min=0) * (tau - pause)  # [16, F]
        lost.append(1 - kept.sum(1) / wall)
    return torch.cat(lost)


def _measured_best(cluster: tuple) -> tuple[float, float]:
    """The interval of least measured loss and that loss: a grid of intervals, then a finer one around its best."""
    mtbf, pause, _, _ = cluster
    taus = torch.logspace(math.log10(pause * 1.001), math.log10(20 * mtbf), 60, dtype=torch.float64)  # host: judge
    lost = simulate(*cluster, taus)
    i = int(lost.argmin())
    fine = torch.linspace(
        float(taus[max(i - 1, 0)]), float(taus[min(i + 1, len(taus) - 1)]), 40, dtype=torch.float64
    )  # host
    lost = simulate(*cluster, fine)
    j = int(lost.argmin())
    return float(fine[j]), float(lost[j])


def collect_checkpoint_cost(choose_interval) -> dict:
    out = []
    with library_calls(LIBRARY) as called:
        for cluster in CLUSTERS:
            try:
                answer = choose_interval(*cluster)
                out.append([_plain(v) for v in answer] if isinstance(answer, (tuple, list)) else _plain(answer))
            except Exception as exc:  # a wrong answer's error is reported, not raised
                out.append(f"{type(exc).__name__}: {str(exc)[:80]}")
    return {"answers": out, "library": list(called)}


def _said(cluster: tuple) -> str:
    mtbf, pause, write, restart = cluster
    return f"MTBF {mtbf:g} s, pause {pause:g} s, write {write:g} s, restart {restart:g} s"


def judge_checkpoint_cost(data) -> list[str]:
    lines = [_library_line("checkpoint_cost", data["library"])]
    for cluster, answer in zip(CLUSTERS, data["answers"], strict=True):
        said = _said(cluster)
        try:
            tau, lost = (float(v) for v in answer)
            ok = math.isfinite(tau) and math.isfinite(lost) and tau > cluster[1]
        except (TypeError, ValueError):
            ok = False
        if not ok:
            lines.append(f"{said}: expected (interval > pause, lost fraction), received {str(answer)[:80]}: FAIL")
            continue
        _, best = _measured_best(cluster)
        measured = float(simulate(*cluster, torch.tensor([tau], dtype=torch.float64))[0])  # host: the judge's
        # The PASS lines name no number of the answer: the grader compares them with the solution's, and every
        # interval within the slack (and every prediction within its tolerance) is right. The numbers are shown
        # on a line of their own (not scored), and in the FAIL lines.
        lines.append(
            f"{said}: your interval {tau:.4g} s lost {measured:.4f} of the time measured (the least any interval "
            f"lost: {best:.4f}); you predicted {lost:.4f}"
        )
        what = f"{said}: your interval lost within {SIM_SLACK:.0%} of the least any interval lost"
        lines.append(
            f"{what}: PASS"
            if measured <= best * (1 + SIM_SLACK)
            else f"{what}: expected at most {best * (1 + SIM_SLACK):.4f}, received {measured:.4f} (interval "
            f"{tau:.4g} s): FAIL"
        )
        what = f"{said}: your predicted loss within {LOSS_RTOL:.0%} of the loss measured at your interval"
        lines.append(
            f"{what}: PASS"
            if abs(lost - measured) <= LOSS_RTOL * measured
            else f"{what}: expected {measured:.4f}, received {lost:.4f}: FAIL"
        )
    return lines


# No prediction cell: checkpoint_cost's interval and loss are checked against a measured run, not a theory.
THEORY: dict = {}
