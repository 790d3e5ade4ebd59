"""Lab 11's checks: surviving dead machines without changing the training, the tensor-parallel layout of the lab
model with its checkpoint writers chosen, and the reshard of a ZeRO checkpoint of the lab model into that layout on
another number of ranks, on live ranks (see parlab/grading).

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
    part 3  reshard          a ZeRO checkpoint of the lab model written by 3 ranks, loaded into those boxes on M = 2
                             and 4 ranks, reading each element of the box once, nothing else, in the fewest reads
    predict checkpoint_cost  when reading a box of columns row by row beats reading it as one range (a Llama-size
                             matrix), the best interval and the time lost with asynchronous checkpoints

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
from parlab.grading.labs import prediction_lines, run_check
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
# F = 64, 2 blocks, untied, float64). Its ZeRO checkpoint is written by 3 ranks (no ZeRO unit of it divides by 3)
# after SAVED_AT Adam steps of 6 rows.
LAB = LabConfig()
SAVED_BY, SAVED_AT, LAB_B = 3, 3, 6
LAB_BATCHES = lab_batches(LAB, LAB_B, SAVED_AT, seed=0)
TP_WORLDS = (2, 4)  # the reshard's M: 4 exceeds the 2 K/V heads, each of which two ranks then hold
# tp_layout's cases: (query heads, K/V heads, M, blocks) of the lab model with H = 32 (V = F = 64): GQA with its K/V
# heads split and replicated, multi-head (nkv = nq) and multi-query (nkv = 1) attention, 1 to 3 blocks. Where the
# shared boxes are many (3 blocks), placing them in the model's order, smallest first or round-robin leaves a
# writer heavier than need be; so does torch.distributed.checkpoint's dedup (each item, in order, to the holder
# with the least planned so far).
LAYOUT_CASES = [(4, 2, 1, 1), (8, 4, 2, 1), (8, 8, 4, 1), (4, 2, 4, 2), (8, 2, 8, 1), (8, 2, 8, 3), (4, 1, 4, 3)]
SAVE_M = 4  # the real save: the lab model itself (case (4, 2, 4, 2)) on 4 ranks, with the student's writers
# The prediction. Reading a box of columns: Llama-3-70B's MLP down projection [H, F] = [8192, 28672] in bf16, saved
# in one piece, loaded by rank READ_RANK of READ_M tensor-parallel ranks; a read costs READ_LATENCY_S plus its bytes
# at READ_BANDWIDTH bytes/s. The cluster: devices, each failing every DEVICE_MTBF_HOURS; a checkpoint pauses training
# PAUSE_S, then is written in the background for WRITE_S (complete PAUSE_S + WRITE_S after its pause began); a
# restart takes RESTART_S.
READ_ROWS, READ_COLS, READ_M, READ_RANK, READ_BYTES = 8192, 28672, 8, 3, 2
READ_LATENCY_S, READ_BANDWIDTH = 20e-6, 2e9
DEVICE_MTBF_HOURS, DEVICES, PAUSE_S, WRITE_S, RESTART_S = 50_000, 4096, 6, 120, 300
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
    "reshard": "a ZeRO checkpoint of the lab model written by 3 ranks, loaded into each rank's tensor-parallel box "
    "on M = 2 and 4 ranks: every rank's part of every tensor (weights, Adam m and v) equals the checkpoint's "
    "exactly, with the box's shape; the elements your code read (each read a range of one saved piece) are exactly "
    "the box's, each once (a read of a range that spans the gaps between a column box's rows fails, as does "
    "reading whole pieces); no two reads that one read could make (consecutive ranges of one piece: reading a row "
    "box row by row fails; a FAIL names the two reads, not the fewest count); the weights put back together equal "
    "one device after the same steps; no call into parlab's checkpoint code",
    "checkpoint_cost": "the read latency at which reading a box of columns row by row (every element once) and "
    "reading it as one range (the other ranks' columns between its rows included) take equally long, and the least "
    "time any set of reads takes at 20 microseconds (Llama-3-70B's down projection, bf16, 8 ranks, 2 GB/s); the "
    "best checkpoint interval and the time lost with asynchronous checkpoints and restarts; each within 0.2% of the "
    "judge's theory (THEORY)",
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


# ---- reshard: a ZeRO checkpoint of the lab model into the tensor-parallel boxes


def zero_save_lab_rank(root: str) -> None:
    """Rank code: ZeRO-2 trains the lab model SAVED_AT Adam steps on this rank's rows and saves its sharded
    checkpoint under root (parlab's own code: every rank its flat shard's pieces, rank 0 the metadata)."""
    P, rank = comm.group_size(), comm.group_rank()
    zero = ZeRO(build_lab_model(LAB, seed=0, device=parlab.device()), 2, lr=LR)
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


def _one_read_could_do(reads: list) -> str:
    """Two reads that one read could make: consecutive ranges of the same piece (reads that take each element of
    the box once and nothing else are more than the fewest exactly when two of them are), or, for reads that take
    other elements too, how many they were."""
    ends = {(q, b): (a, b) for q, a, b in reads}
    for q, a, b in reads:
        if (q, a) in ends:
            a0, b0 = ends[q, a]
            return f"reads [{a0}, {b0}) and [{a}, {b}) of rank {q}'s piece are one range of it: one read takes both"
    return f"{len(reads)} reads, some of elements outside the box or read twice"


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
                    too_many = f"rank {r} {name}, box {_box_said(box)}: {_one_read_could_do(reads)}"
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


def read_times(latency: float) -> tuple[float, float]:
    """Seconds to read rank READ_RANK's box of columns of the [READ_ROWS, READ_COLS] matrix saved whole (row-major),
    at `latency` per read and READ_BANDWIDTH: (one read per row, every element once; one read of the range from the
    box's first element to its last, the other ranks' columns between its rows included). Any set of reads that
    covers the box lies between: each read beyond the first saves the gap between two rows (READ_COLS minus the
    box's columns) and costs one latency, so the time is linear in the number of reads and one of the two is
    the least."""
    width = READ_COLS // READ_M  # the box's columns
    box = READ_ROWS * width * READ_BYTES
    gap = (READ_COLS - width) * READ_BYTES  # bytes between the end of a row of the box and the start of the next
    by_row = READ_ROWS * latency + box / READ_BANDWIDTH
    one_range = latency + (box + (READ_ROWS - 1) * gap) / READ_BANDWIDTH
    return by_row, one_range


def checkpoint_cost_theory() -> dict[str, float]:
    """The prediction's theory: the latency at which row by row and one range take equally long (one latency per
    gap saved: the gap's read time), the least time to read the box at READ_LATENCY_S, the interval between
    checkpoints that loses the least time and the percent lost at it."""
    gap = (READ_COLS - READ_COLS // READ_M) * READ_BYTES
    mtbf = DEVICE_MTBF_HOURS * 3600 / DEVICES
    tau = _best_interval(mtbf)
    return {
        "crossover_us": gap / READ_BANDWIDTH * 1e6,
        "best_ms": min(read_times(READ_LATENCY_S)) * 1e3,
        "tau_minutes": tau / 60,
        "lost_percent": 100 * _lost_fraction(tau, mtbf),
    }


def collect_checkpoint_cost(crossover_us, best_ms, tau_minutes, lost_percent) -> dict:
    return {"predicted": [_plain(v) for v in (crossover_us, best_ms, tau_minutes, lost_percent)]}


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
    crossover_us, best_ms, tau_minutes, lost_percent = data["predicted"]
    lines = prediction_lines(
        "the read latency (microseconds) at which row by row and one range read the box equally fast",
        crossover_us,
        theory["crossover_us"],
        rtol=0.002,
    )
    lines += prediction_lines(
        f"the least time to read the box at {READ_LATENCY_S * 1e6:g} microseconds a read (ms)",
        best_ms,
        theory["best_ms"],
        rtol=0.002,
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
