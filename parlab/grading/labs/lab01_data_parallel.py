"""Lab 01's checks: rows shared out by real tokens, the mean over the real tokens of a padded batch from one
all-reduce, bucketed all-reduces started from gradient hooks during backward with the buckets rebuilt in the order
backward produces the gradients (DDP's bucket rebuild), and gradient accumulation over uneven micro-batches (one of
them empty) that averages by tokens with nothing but the buckets' all-reduces, on live ranks (see
parlab/grading/labs/).

The model is the labs' own (parlab.core.lab_model: RMSNorm, grouped-query attention, RoPE, SwiGLU); in parts 3 and 4
with its embedding tied to the LM head, and with its modules registered in the order Meta's Llama code registers
them (`checks_model`): attention, feed-forward, then the two norms; in the feed-forward w1 = gate, w2 = down, w3 = up.
So the reverse of the registration order, DDP's first bucket plan, is not the order backward produces the
gradients: buckets complete out of plan order, and the tied matrix, whose gradient is complete only when backward
reaches the embedding, arrives last. And the ranks do not all run the same build of the code: on some ranks the
feed-forward evaluates up(x) before gate(x) (the same numbers), so backward there produces gate's gradient before
up's. Which ranks, changes from case to case (`OVERLAP_UP_FIRST`, rank 0 among them in one case; the handout says
only that some ranks' builds differ): an answer cannot know another rank's order without asking it. Buckets rebuilt
by each rank from its own order differ across ranks with the same sizes: the all-reduces then sum one rank's up with
another's gate, silently. The ranks must agree on one order (rank 0's, as DDP does).

The batches of parts 2 and 4 are padded: row i holds L_i real tokens, then padding (`padded_batches`); the rows of a
rank, or a micro-batch, may hold none. In part 2 the real tokens are documents packed one after the other (row after
row, across ranks: `documents`) and a step's loss is the mean over the documents of each document's mean
cross-entropy; in part 4 it is the mean cross-entropy over the real tokens of the whole global batch.

Every check compares with one device training on the whole batch (float64, 1e-10), and verifies from what the
ranks did how they communicated: the calls each rank made into torch.distributed and their bytes
(parlab.core.probe), in which gradient's hook each all-reduce started (the check's own gradient hooks, registered
before the student's, note how many calls had been made when each gradient arrived and when each backward pass
ended), and every wait on an all-reduce's handle (`HandleWatch`: torch's Work, however it was reached), so that a
wait in a hook is seen whatever the timing, even on a handle already complete. Calls into the library's
data-parallel code are seen by a profile hook (guard.py) and fail the part.
"""

from __future__ import annotations

import functools
import math
import signal
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._C._distributed_c10d import ProcessGroup, Work

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model, lab_batches, lab_loss
from parlab.core.models import make_optimizer
from parlab.grading.labs import error_summary, prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.notebook_watch import NotebookWatch
from parlab.runtime.errors import RankError

LAUNCH = {"timeout": 30, "echo": False}  # a hang (a collective some rank never calls) is diagnosed after 30 s
# What the parts must not call: the library's data parallelism, its lesson, its runs and its torch twin.
LIBRARY = ("schemes/data_parallel.py", "lessons/data_parallel.py", "runs/data_parallel.py", "twins/data.py")
LR = 0.1  # SGD
PAD = 0  # the token id of padding (what it is does not matter: no real token attends to a later position)

CFG = LabConfig()  # part 2: the lab model, untied, float64 (22,688 parameters)
TIED = LabConfig(tied=True)  # parts 3, 4 and the prediction: the embedding is the LM head (20,640 parameters)

# Part 1: real tokens per row, and the ranks. Chosen so that cutting at the average, at the prefix sums nearest
# k/P of the total, or greedily to a bound without making every block non-empty, all miss the least busiest rank.
SHARD_CASES = [
    ([6, 2, 0, 4, 9, 8, 13, 7], 4),
    ([16, 5, 9, 12, 3, 16, 0, 0], 3),
    ([10, 0, 0, 5, 5], 3),
    ([3, 0, 7, 1], 4),
    ([8, 11, 16, 0, 14, 7, 1, 5, 3, 11, 15, 7, 12, 3, 7, 0, 6, 13, 8, 5, 12, 5, 2, 4], 5),
]
SHARD_REFUSED = ([4, 9], 3)  # fewer rows than ranks
# A batch too large to try every split (C(63, 7) = 553,270,671 of them): answered within SHARD_SECONDS, or FAIL.
SHARD_LARGE = (
    [14, 14, 14, 16, 6, 5, 16, 15, 5, 3, 14, 9, 4, 2, 1, 12, 14, 5, 0, 16, 2, 1, 1, 6, 7, 0, 14, 10, 14, 6, 16, 7]
    + [9, 15, 0, 2, 14, 8, 13, 2, 8, 10, 7, 16, 9, 0, 2, 3, 12, 3, 9, 12, 2, 0, 0, 6, 6, 1, 15, 12, 12, 13, 2, 6],
    8,
)
SHARD_SECONDS = 10

# Part 2: 8 rows on 3 ranks holding 3, 3 and 2 of them, 2 steps; in step 1 the last rank's rows are all padding.
AVG_ROWS = (3, 3, 2)
AVG_LENGTHS = [[16, 5, 9, 12, 3, 16, 0, 0], [7, 0, 11, 2, 16, 9, 4, 13]]  # real tokens per row, per step
# The documents' lengths, packed in order over the real tokens, row after row: in step 1 document 1 runs from rank 0
# into rank 1; in step 2 document 1 runs over all three ranks.
AVG_DOCS = [[7, 28, 4, 19, 3], [5, 42, 7, 8]]
MAX_EXTRA = 2  # numbers a step may all-reduce beyond one copy of the gradients (parts 2 and 4)
AGREE_INTS = 20  # parts 3-4: after step 1's backward, one collective of at most P x 20 int64 may agree on the order

CAP = 16 * 1024  # parts 3 and 4: a bucket closes once it holds at least this many bytes
DP_RANKS = 2  # parts 3 and 4
OVERLAP_B, OVERLAP_STEPS = 8, 2  # part 3: 4 rows per rank, no padding, 2 steps (the first plan, then the rebuilt one)
OVERLAP_BATCHES = lab_batches(TIED, OVERLAP_B, OVERLAP_STEPS, seed=1)
# Part 3's cases: the ranks whose build computes up before gate. Rank 1 has that build in both, rank 0 only in the
# second: no rule on a rank's own order and number (keep it, swap it, odd ranks swap, canonical) gives rank 0's order
# in both; only asking rank 0 does.
OVERLAP_UP_FIRST = ((1,), (0, 1))
ACC_UP_FIRST = (0,)  # part 4: rank 0's build computes up before gate, rank 1's does not

# Part 4: 7 rows on 2 ranks holding 5 and 2, in M = 3 micro-batches (x_r.tensor_split(3): 2, 2, 1 and 1, 1, 0
# rows); in step 1 rank 0's last micro-batch is one row of padding, and in both steps rank 1's last one is empty.
ACC_ROWS, ACC_M, ACC_STEPS = (5, 2), 3, 2
ACC_LENGTHS = [[9, 16, 4, 12, 0, 7, 3], [0, 5, 16, 2, 8, 11, 0]]
# The prediction: ranks, micro-batches, batch, bucket cap, the ranks whose build computes up before gate.
TRAFFIC = {"P": 4, "M": 3, "B": 24, "cap": CAP, "up_first": (0, 3)}


def padded_batches(cfg: LabConfig, lengths: list[list[int]], seed: int) -> list[tuple]:
    """One global batch per entry of `lengths`: (x, y, mask), each [B, T]. Row i holds lengths[i] real tokens, then
    padding: mask[i, t] is True where the target y[i, t] is a real token (t < lengths[i]); x and y hold PAD
    elsewhere. A step's loss is the mean cross-entropy over the real tokens of the whole batch."""
    batches = []
    for (x, y), rows in zip(lab_batches(cfg, len(lengths[0]), len(lengths), seed=seed), lengths, strict=True):
        positions = torch.arange(cfg.seq_len)  # host: the batch is drawn and masked on the host
        mask = positions[None, :] < torch.tensor(rows)[:, None]  # host: [B, T], True for real tokens
        batches.append((x.masked_fill(~mask, PAD), y.masked_fill(~mask, PAD), mask))
    return batches


def documents(mask: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents packed over the real tokens of a padded batch (mask: [B, T]), row after row, in the order of
    `lengths`: (doc, doc_len), each [B, T] int64. doc[i, t] is the document of target y[i, t] (-1 at padding);
    doc_len[i, t] is that document's number of real tokens in the whole batch (0 at padding), wherever they lie."""
    doc = torch.full(mask.shape, -1, dtype=torch.int64)  # host: the batch is built on the host
    doc_len = torch.zeros(mask.shape, dtype=torch.int64)  # host: the batch is built on the host
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # host: [n] document of token
    doc[mask] = ids  # row-major: the real tokens in the order the stream packs them
    doc_len[mask] = torch.tensor(lengths)[ids]  # host: the batch is built on the host
    return doc, doc_len


AVG_BATCHES = [
    (x, y, *documents(mask, docs))
    for (x, y, mask), docs in zip(padded_batches(CFG, AVG_LENGTHS, 0), AVG_DOCS, strict=True)
]  # (x, y, doc, doc_len) per step, each [B, T]
ACC_BATCHES = padded_batches(TIED, ACC_LENGTHS, seed=2)

STRUCTURAL = {
    "shard": "six batches (rows with 0 to 16 real tokens, on 3 to 8 ranks, one with as many rows as ranks, one of 64 "
    "rows on 8 ranks with too many splits to try each, answered within 10 s): every "
    "rank a contiguous block of at least one row, the blocks in rank order covering the batch, the busiest rank's "
    "real tokens the least any such split allows (the judge's optimum, by dynamic programming over every split; "
    "cutting at the average or at the prefix sums fails, and so does a greedy cut that leaves a rank without rows; "
    "FAIL: expected and received rows or tokens); fewer rows than ranks raises ValueError; no library code called",
    "average": "the untied lab model on 3 ranks holding 3, 3 and 2 padded rows of packed documents (in step 1 the "
    "third rank's rows are all padding and a document runs from rank 0 into rank 1; in step 2 one runs over all "
    "three ranks), 2 SGD steps: the loss each rank returns, every rank's gradients and parameters equal one device's "
    "mean over the documents of each document's mean cross-entropy (the token mean fails; so does dividing by the "
    "documents each rank sees, which counts a split document twice; a NaN from a rank without tokens fails); per "
    "rank and step exactly one collective, an all-reduce of one copy of the gradients and at most 2 numbers more "
    "(one all-reduce per parameter, or a second one for a count, fails); no library code called",
    "overlap": "2 cases of 2 ranks, 2 steps each, of the tied lab model registered as Meta's Llama, rank 1 producing "
    "gate's gradient before up's in both and rank 0 in the second only (so no rule on a rank's own order and number "
    "finds rank 0's order in both; one without the agreement fails a case): parameters equal one device (buckets "
    "rebuilt by each rank from its own order have the same sizes but sum rank 0's up with rank 1's gate: the "
    "parameters fail); step 1 all-reduces the first plan's buckets and, after backward, at most one collective of at "
    "most P x 20 integers to agree on the order; step 2 the buckets rebuilt in the order rank 0's backward produced "
    "the gradients, each in plan order and nothing else (FAIL: the first call that differs); each bucket started in "
    "the hook of the gradient that completed it and every bucket before it on that rank (not earlier, not after); no "
    "wait() at all on an all-reduce's handle during backward (a hook that waits even on a handle is_completed() "
    "reported done, as parlab's BucketedDP does, fails), no blocking all-reduce (seen on torch's Work itself, "
    "whatever the timing); every all-reduce waited for by the end of finish(); no library code",
    "step_traffic": "the predicted bytes that start only with the last gradient, and on rank 0 and on rank 1 the "
    "bytes of buckets complete before they may start, per step once the buckets are rebuilt (tied lab model, P=4, "
    "ranks 0 and 3 computing up before gate, M=3, cap 16 KiB; the first plan, or each rank's own order, gives other "
    "numbers), exactly against the theory and against parlab's bucketed DP run with that plan, measured; no library "
    "call from the notebook's cells",
    "training": "2 steps on 2 ranks holding 5 and 2 padded rows in 3 micro-batches (one of only padding, one empty; "
    "rank 0 computing up before gate): a rank that raises (e.g. a forward on the empty micro-batch) is a FAIL line "
    "naming the rank and its error; the loss each rank returns and every parameter equal one device's mean over the "
    "real tokens of the whole batch; on every rank and step: the plan's buckets all-reduced once each in plan order "
    "(step 1 the first plan and at most the one collective that agrees on the order after backward, step 2 rank 0's "
    "rebuilt one) with at most 2 numbers more in all and nothing else, all of them during the last backward pass the "
    "rank ran, each in the hook of the gradient that completed it and every bucket before it; none in flight at the "
    "optimizer step; no library code",
}

WATCH = NotebookWatch(LIBRARY)  # the notebook's own cells (the prediction): started by the setup cell


def watch_notebook() -> None:
    """Setup cell: from now on, calls into LIBRARY from this notebook's cells are noted (and fail the prediction)."""
    WATCH.start()


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading.labs. The watch of the notebook's cells ends once the prediction is checked."""
    with WATCH.paused():
        run_check(__name__, check, *answers)
    if check in ("step_traffic", "training"):
        WATCH.stop()


# ------------------------------------------------------------------------------------------- the checks' model


def _register_as_meta_llama(model: torch.nn.Module) -> torch.nn.Module:
    """Re-register each block's modules in the order of Meta's Llama code (TransformerBlock: attention,
    feed_forward, attention_norm, ffn_norm; FeedForward: w1 = gate, w2 = down, w3 = up). The weights, their names and
    the forward are unchanged: only the order of model.parameters() changes."""
    for block in model.blocks:
        for module, order in [(block, ("attn", "mlp", "attn_norm", "mlp_norm")), (block.mlp, ("gate", "down", "up"))]:
            children = dict(module._modules)
            module._modules.clear()
            module._modules.update((name, children[name]) for name in order)
    return model


def _up_first(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU as another build of the code computes it: up(x) before gate(x). The same numbers; autograd runs the
    later node first, so backward produces gate's gradient before up's. x: [B, T, H] -> [B, T, H]."""
    up = mlp.up(x)  # [B, T, F]
    return mlp.down(F.silu(mlp.gate(x)) * up)


def checks_model(up_first: bool = False) -> torch.nn.Module:
    """The model of parts 3 and 4: the tied lab model (float64), registered as Meta's Llama registers its modules,
    on this rank's device; with up_first, the build whose feed-forwards compute up before gate (the checks give it
    to some ranks). Same weights, same numbers, as build_lab_model(TIED, 0)."""
    model = _register_as_meta_llama(build_lab_model(TIED, 0, device=parlab.device()))
    if up_first:
        for block in model.blocks:
            block.mlp.forward = functools.partial(_up_first, block.mlp)
    return model.to(parlab.device())


def plan_in_order(model: torch.nn.Module, names: list[str], cap_bytes: int) -> list[list[str]]:
    """Buckets of the parameters `names`, taken in the order given: a bucket is closed once it holds at least
    cap_bytes of gradients, and the next parameter opens a new one. Returns the names per bucket, bucket 0 first."""
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    buckets, filled = [[]], 0
    for name in names:
        if filled >= cap_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += sizes[name]
    return [bucket for bucket in buckets if bucket]


def first_plan(model: torch.nn.Module, cap_bytes: int) -> list[list[str]]:
    """DDP's plan before its first step: the parameters in the REVERSE of their registration order (the order of
    model.named_parameters()), cut into buckets of at least cap_bytes."""
    return plan_in_order(model, [name for name, _ in reversed(list(model.named_parameters()))], cap_bytes)


def _rank_model(up_first_ranks: tuple[int, ...]) -> torch.nn.Module:
    """Rank code: this rank's build of checks_model in a case where the ranks up_first_ranks compute up before gate."""
    return checks_model(up_first=dist.get_rank() in up_first_ranks)


@functools.lru_cache(maxsize=2)
def arrival_order(up_first: bool = False) -> tuple[str, ...]:
    """The order in which one backward of checks_model(up_first) produces its gradients (one device, its own
    hooks)."""
    model = checks_model(up_first)
    x, y = OVERLAP_BATCHES[0]
    order = []
    names = {id(p): name for name, p in model.named_parameters()}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)])) for p in model.parameters()]
    lab_loss(model(x), y).backward()
    for hook in hooks:
        hook.remove()
    return tuple(order)


def rebuilt_plan(cap_bytes: int, up_first: bool) -> list[list[str]]:
    """The buckets rebuilt in the order the build checks_model(up_first) produces the gradients: every rank uses rank
    0's, so up_first is rank 0's build (the theory of parts 3-4 and the prediction)."""
    return plan_in_order(checks_model(), list(arrival_order(up_first)), cap_bytes)


@functools.lru_cache(maxsize=1)
def _sizes() -> dict[str, int]:
    return {name: p.numel() * p.element_size() for name, p in checks_model().named_parameters()}


def _bucket_bytes(plan: list[list[str]]) -> list[int]:
    return [sum(_sizes()[name] for name in bucket) for bucket in plan]


def _completes(plan: list[list[str]], up_first: bool) -> list[int]:
    """Per bucket k: the index (in build up_first's arrival order) of the gradient that completes it."""
    position = {name: i for i, name in enumerate(arrival_order(up_first))}
    return [max(position[name] for name in bucket) for bucket in plan]


def _starts(plan: list[list[str]], up_first: bool) -> list[int]:
    """Per bucket k: the index (in build up_first's arrival order) of the gradient whose hook must start it: the last
    gradient of buckets 0..k to arrive (a bucket starts once it and every bucket before it are complete)."""
    complete = _completes(plan, up_first)
    return [max(complete[: k + 1]) for k in range(len(plan))]


def token_mean_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference's loss: the mean cross-entropy over the real tokens (mask) of x, y: [B, T]."""
    logits = model(x)  # [B, T, V]
    return F.cross_entropy(logits[mask], y[mask])  # [n, V] against [n]: the n real tokens


def document_mean_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, doc: torch.Tensor, doc_len: torch.Tensor
) -> torch.Tensor:
    """The reference's loss in part 2: the mean over the D documents of each document's mean cross-entropy; x, y,
    doc, doc_len: [B, T] (see `documents`)."""
    mask = doc >= 0  # [B, T]: the real tokens
    ce = F.cross_entropy(model(x)[mask], y[mask], reduction="none")  # [n]
    means = torch.zeros(int(doc.max()) + 1, dtype=ce.dtype).index_add_(0, doc[mask], ce)  # host: [D] sums
    return (means / torch.bincount(doc[mask]).to(ce.dtype)).mean()  # the mean of the D documents' means


def _train_reference(cfg: LabConfig, batches) -> dict:
    """One device, the whole padded batch, SGD: the loss of each step, the gradients of step 1, the parameters after
    the last step (by name). The order the parameters are registered in changes nothing here."""
    model = build_lab_model(cfg, seed=0)
    opt = make_optimizer(model.parameters(), "sgd", LR)
    losses, grads = [], None
    for x, y, *rest in batches:
        opt.zero_grad()
        loss = document_mean_loss(model, x, y, *rest) if cfg is CFG else token_mean_loss(model, x, y, *rest)
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": torch.tensor(losses, dtype=torch.float64), "grads": grads, "params": params}  # host: numbers


@functools.lru_cache(maxsize=3)
def _reference(part: str) -> dict:
    if part == "average":
        return _train_reference(CFG, AVG_BATCHES)
    if part == "training":
        return _train_reference(TIED, ACC_BATCHES)
    return _train_reference(TIED, [(x, y, torch.ones_like(x, dtype=torch.bool)) for x, y in OVERLAP_BATCHES])  # 3


# ------------------------------------------------------------------------------------------- what the ranks did


class GradientWatch:
    """The check's own gradient hooks, registered before anyone else's: at each gradient's arrival during backward,
    which parameter arrived and how many calls into torch.distributed the rank had made so far (`calls`: the
    probe's record); at the end of each backward pass (autograd's queued callback), the calls made by then. One
    entry of `passes` per backward pass: {"arrivals": [(name, calls so far)], "ended": calls when it returned}."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list | None = None
        self.passes: list[dict] = []
        self.running = False  # inside a backward pass (between its first gradient and its end)
        names = {id(p): name for name, p in model.named_parameters()}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self._arrived(names[id(p)]))

    def _made(self) -> int:
        return len(self.calls) if self.calls is not None else 0

    def _arrived(self, name: str) -> None:
        if not self.running:  # the first gradient of a backward pass: note its end when autograd is done
            self.running = True
            self.passes.append({"arrivals": [], "ended": None})
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)
        self.passes[-1]["arrivals"].append((name, self._made()))

    def _ended(self) -> None:
        self.passes[-1]["ended"] = self._made()
        self.running = False

    def since(self, first_pass: int, first_call: int) -> list[dict]:
        """The passes from `first_pass` on, their call counts taken from call `first_call` on."""
        return [
            {
                "arrivals": [(name, made - first_call) for name, made in p["arrivals"]],
                "ended": (p["ended"] if p["ended"] is not None else self._made()) - first_call,
            }
            for p in self.passes[first_pass:]
        ]


class HandleWatch:
    """The check's view of every all-reduce's handle: torch's Work object, however the answer reached it
    (parlab.core.comm, torch.distributed, asynchronous or not: a blocking all-reduce waits on its Work too).
    `blocked`: each wait() made during a backward pass on an all-reduce's handle, with the gradient in whose hook it
    came: the lab forbids them all, done or not (whether one is done is a matter of timing). `pending`: the handles
    not yet waited for."""

    def __init__(self, gradients: GradientWatch):
        self.gradients = gradients
        self.pending: list = []  # Work objects issued and not waited for yet (kept alive: their ids stay theirs)
        self.blocked: list[str] = []

    @contextmanager
    def watching(self):
        issue, wait = ProcessGroup.allreduce, Work.wait
        watch = self

        def watched_allreduce(group, *args, **kwargs):
            work = issue(group, *args, **kwargs)
            if work is not None:
                watch.pending.append(work)
            return work

        def watched_wait(work, *args, **kwargs):
            if watch.gradients.running and any(w is work for w in watch.pending):
                arrivals = watch.gradients.passes[-1]["arrivals"]
                watch.blocked.append(arrivals[-1][0] if arrivals else "?")
            result = wait(work, *args, **kwargs)
            watch.pending = [w for w in watch.pending if w is not work]
            return result

        watched = {"allreduce": watched_allreduce, "wait": watched_wait}
        with (
            probe.wrapped(ProcessGroup, {"allreduce": issue}, lambda name, original: watched[name]),
            probe.wrapped(Work, {"wait": wait}, lambda name, original: watched[name]),
        ):
            yield self

    def take(self) -> tuple[list[str], int]:
        """(the blocking waits noted, the handles in flight) since the last take(); forget the waits."""
        blocked, self.blocked = self.blocked, []
        return blocked, len(self.pending)


def _plain_calls(calls) -> list[dict]:
    return [{"op": c["op"], "bytes": int(c["bytes"])} for c in calls]


def _block(rows: tuple[int, ...], rank: int) -> slice:
    """The check's own split: rank r holds rows[r] contiguous rows, in rank order."""
    start = sum(rows[:rank])
    return slice(start, start + rows[rank])


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(parlab.device()) for t in tensors]


def _bucket_verdict(label: str, calls, expected: list[int], what: str, extra: int = 0) -> str:
    """One all-reduce per bucket, in plan order, each of the bucket's bytes (with `extra` bytes more allowed over
    all of them), nothing else; FAIL names the first call that differs."""
    more = f", and at most {extra // 8} numbers more in all" if extra else ""
    text = f"{label}: {what}: one all-reduce per bucket, in plan order{more}, nothing else"
    others = sorted({c["op"] for c in calls} - {"allreduce"})
    sizes = [int(c["bytes"]) for c in calls if c["op"] == "allreduce"]
    if others:
        return f"{text}: expected only all-reduces, received {others}: FAIL"
    for k, (want, got) in enumerate(zip(expected, sizes, strict=False)):
        if not want <= got <= want + extra:
            return f"{text}: all-reduce {k}: expected bucket {k} ({want:,} bytes), received {got:,} bytes: FAIL"
    if len(sizes) != len(expected):
        return f"{text}: expected {len(expected)} all-reduces, received {len(sizes)}: FAIL"
    if sum(sizes) > sum(expected) + extra:
        return f"{text}: expected at most {sum(expected) + extra:,} bytes in all, received {sum(sizes):,}: FAIL"
    return f"{text}: PASS"


def _agreement(label: str, step: dict, world: int) -> tuple[list[dict], str]:
    """Step 1: the calls made after the last backward pass ended may hold one collective that agrees on the order
    (at most world x AGREE_INTS int64). Returns (the calls before it, the verdict line)."""
    calls, passes = step["calls"], step["passes"]
    ended = passes[-1]["ended"] if passes else len(calls)
    after, most = calls[ended:], 8 * AGREE_INTS * world
    what = f"{label}: step 1, after backward: at most one collective to agree on the order (at most {most} bytes)"
    if len(after) > 1:
        ops = ", ".join(c["op"] for c in after[:4])
        return calls[:ended], f"{what}: received {len(after)} calls ({ops}{', ...' if len(after) > 4 else ''}): FAIL"
    if after and after[0]["bytes"] > most:
        return calls[:ended], f"{what}: received a {after[0]['op']} of {after[0]['bytes']:,} bytes: FAIL"
    return calls[:ended], f"{what}: PASS"


def _start_verdict(
    label: str, calls, passes: list[dict], plan: list[list[str]], what: str, up_first: bool, extra: int = 0
) -> str:
    """Each bucket started in the last backward pass, in the hook of the gradient that completed it and every bucket
    before it, in the order the rank's build (up_first) produces the gradients."""
    when = "in the last backward pass the rank ran, " if extra else ""  # part 4 (accumulation)
    text = f"{label}: {what}: each bucket started {when}as soon as it and every bucket before it were complete"
    allreduces = [i for i, c in enumerate(calls) if c["op"] == "allreduce"]
    expected = _bucket_bytes(plan)
    if len(allreduces) != len(expected) or any(
        not want <= calls[i]["bytes"] <= want + extra for i, want in zip(allreduces, expected, strict=True)
    ):
        return f"{text}: not checked, the all-reduces are not the plan's buckets: FAIL"
    if not passes:
        return f"{text}: no backward pass ran: FAIL"
    order, last = arrival_order(up_first), passes[-1]
    arrivals, first = last["arrivals"], last["arrivals"][0][1]
    for k, (call, expected_at) in enumerate(zip(allreduces, _starts(plan, up_first), strict=True)):
        if call >= last["ended"]:
            where = "after backward returned"
        elif call < first:
            earlier = [j for j, p in enumerate(passes[:-1]) if p["arrivals"][0][1] <= call < p["ended"]]
            where = f"in backward pass {earlier[0] + 1} of {len(passes)}" if earlier else "before the last backward"
        else:
            i = max(i for i, (_, made) in enumerate(arrivals) if made <= call)
            if i == expected_at:
                continue
            where = f"when {arrivals[i][0]} arrived"
        return f"{text}: bucket {k} started {where}; expected when {order[expected_at]} arrived: FAIL"
    return f"{text}: PASS"


# ------------------------------------------------------------------------------------------ 1 · the rows


def _optimum(tokens: list[int], P: int) -> int:
    """The least busiest rank over every split of the rows into P contiguous non-empty blocks (dynamic programming
    over (blocks, rows): best[k][i] is the least busiest block when the first i rows form k blocks)."""
    prefix = [0]
    for t in tokens:
        prefix.append(prefix[-1] + t)
    B, inf = len(tokens), float("inf")
    best = [[inf] * (B + 1) for _ in range(P + 1)]
    best[0][0] = 0
    for k in range(1, P + 1):
        for i in range(k, B + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    return int(best[P][B])


def _plain_rows(value) -> list | str:
    """An answer's rows per rank as plain ints for the grader, or its repr when it is not a list of ints."""
    try:
        rows = [int(v) for v in value]
        if all(float(v) == r for v, r in zip(value, rows, strict=True)):
            return rows
    except (TypeError, ValueError, OverflowError):
        pass
    return repr(value)[:80]


class _TooLong(Exception):
    pass


def _within(seconds: int, fn, *args):
    """fn(*args), stopped with _TooLong after `seconds` (an alarm: only in the main thread, the kernel's)."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)

    def stop(signum, frame):
        raise _TooLong

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def collect_shard(shard_rows) -> dict:
    received = []
    with library_calls(LIBRARY) as called:
        for tokens, P in [*SHARD_CASES, SHARD_LARGE]:
            try:
                received.append(_plain_rows(_within(SHARD_SECONDS, shard_rows, list(tokens), P)))
            except _TooLong:
                received.append(f"no answer within {SHARD_SECONDS} s")
            except Exception as error:  # noqa: BLE001 (the verdict names what was raised)
                received.append(f"raised {type(error).__name__}: {str(error)[:80]}")
        tokens, P = SHARD_REFUSED
        try:
            shard_rows(list(tokens), P)
            raised = "nothing"
        except ValueError:
            raised = "ValueError"
        except Exception as error:  # noqa: BLE001
            raised = type(error).__name__
    return {"rows": received, "raised": raised, "library": list(called)}


def judge_shard(data) -> list[str]:
    lines = []
    for (tokens, P), rows in zip([*SHARD_CASES, SHARD_LARGE], data["rows"], strict=True):
        B, best = len(tokens), _optimum(tokens, P)
        label = f"B={B} rows on P={P}"
        if (tokens, P) == SHARD_LARGE:
            label += f" (too many splits to try each: {math.comb(B - 1, P - 1):,})"
        what = f"{label}: {P} contiguous blocks in rank order, each at least one row, covering the batch"
        if isinstance(rows, str):
            lines.append(f"{what}: expected {P} row counts, received {rows}: FAIL")
            lines.append(f"{label}: the busiest rank holds the fewest real tokens possible: not checked: FAIL")
            continue
        ok = len(rows) == P and sum(rows) == B and min(rows, default=0) >= 1
        lines.append(f"{what}: PASS" if ok else f"{what}: received {rows} rows per rank: FAIL")
        loads, start = [], 0
        for count in rows:
            loads.append(sum(tokens[start : start + max(count, 0)]))
            start += max(count, 0)
        busiest = max(loads, default=0)
        what = f"{label}: the busiest rank holds the fewest real tokens possible"
        if ok and busiest == best:
            lines.append(f"{what} ({best}): PASS")
        else:
            lines.append(f"{what}: expected {best}, received {busiest} (tokens per rank {loads}): FAIL")
    tokens, P = SHARD_REFUSED
    what = f"B={len(tokens)} rows on P={P} (a rank would get no rows) raises ValueError"
    raised = data["raised"]
    lines.append(f"{what}: PASS" if raised == "ValueError" else f"{what}: received {raised}: FAIL")
    lines.append(library_line("shard_rows", data["library"], "the library's data parallelism"))
    return lines


# ------------------------------------------------------------------------------------- 2 · the token mean


def _run_average(token_step, batches, rows) -> dict:
    model = build_lab_model(CFG, seed=0, device=parlab.device())
    opt = make_optimizer(model.parameters(), "sgd", LR)
    mine = _block(rows, dist.get_rank())
    steps, losses, grads = [], [], None
    with library_calls(LIBRARY) as called:
        for x, y, doc, doc_len in batches:
            opt.zero_grad()
            with probe.recording(keep_sent_data=False) as calls:
                loss = token_step(model, *_on_device(x[mine], y[mine], doc[mine], doc_len[mine]))
            steps.append(_plain_calls(calls))
            losses.append(float(loss))
            if grads is None:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = torch.tensor(losses, dtype=torch.float64)  # host: plain numbers back to the grader
    return {"losses": losses, "grads": grads, "params": params, "steps": steps, "library": called}


def collect_average(token_step) -> dict:
    return {"ranks": list(parlab.launch(_run_average, len(AVG_ROWS), token_step, AVG_BATCHES, AVG_ROWS, **LAUNCH))}


def judge_average(data) -> list[str]:
    ranks, reference = data["ranks"], _reference("average")
    grad_bytes = sum(p.numel() * p.element_size() for p in build_lab_model(CFG).parameters())
    lines = []
    for r, res in enumerate(ranks):
        lines.append(compare(f"rank {r}: the loss it returned, each step", res["losses"], reference["losses"]).line)
        lines.append(compare(f"rank {r}: gradients, step 1", res["grads"], reference["grads"]).line)
        lines.append(
            compare(f"rank {r}: parameters after {len(AVG_BATCHES)} steps", res["params"], reference["params"]).line
        )
    most = grad_bytes + 8 * MAX_EXTRA
    for r, res in enumerate(ranks):
        what = (
            f"rank {r}, every step: one collective, an all-reduce of one copy of the gradients and at most "
            f"{MAX_EXTRA} numbers more ({grad_bytes:,} to {most:,} bytes)"
        )
        wrong = None
        for k, calls in enumerate(res["steps"]):
            ops = [c["op"] for c in calls]
            if ops != ["allreduce"]:
                kinds = ", ".join(f"{ops.count(op)} {op}" for op in sorted(set(ops))) or "none"
                wrong = f"step {k + 1}: received {len(ops)} calls ({kinds})"
            elif not grad_bytes <= calls[0]["bytes"] <= most:
                wrong = f"step {k + 1}: received an all-reduce of {calls[0]['bytes']:,} bytes"
            if wrong:
                break
        lines.append(f"{what}: PASS" if wrong is None else f"{what}: {wrong}: FAIL")
    called = [name for res in ranks for name in res["library"]]
    lines.append(library_line("token_step", called, "the library's data parallelism"))
    return lines


# --------------------------------------------------------------------------- 3 · buckets during backward


def _run_overlap(overlapped_dp, batches, up_first_ranks: tuple[int, ...]) -> dict:
    world, r = dist.get_world_size(), dist.get_rank()
    model = _rank_model(up_first_ranks)
    gradients = GradientWatch(model)  # registered before your hooks: it sees each gradient arrive first
    handles = HandleWatch(gradients)
    opt = make_optimizer(model.parameters(), "sgd", LR)
    mine = _block((len(batches[0][0]) // world,) * world, r)
    steps = []
    with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as called, handles.watching():
        gradients.calls = calls
        dp = overlapped_dp(model, CAP)
        for x, y in batches:
            opt.zero_grad()
            loss = lab_loss(model(*_on_device(x[mine])), *_on_device(y[mine]))
            first_call, first_pass = len(calls), len(gradients.passes)
            loss.backward()
            blocked, _ = handles.take()
            dp.finish()
            _, flying = handles.take()
            steps.append(
                {
                    "calls": _plain_calls(calls[first_call:]),
                    "passes": gradients.since(first_pass, first_call),
                    "blocked": blocked,
                    "in_flight_after_finish": flying,
                }
            )
            opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "steps": steps, "library": called}


def collect_overlap(overlapped_dp) -> dict:
    cases = []
    for up_first in OVERLAP_UP_FIRST:
        cases.append(list(parlab.launch(_run_overlap, DP_RANKS, overlapped_dp, OVERLAP_BATCHES, up_first, **LAUNCH)))
    return {"cases": cases}


def _blocked_verdict(label: str, step: dict) -> str:
    what = f"{label}: backward never waited for an all-reduce in flight (no blocking call, no wait in a hook)"
    blocked = step["blocked"]
    if not blocked:
        return f"{what}: PASS"
    more = f" (and {len(blocked) - 1} more)" if len(blocked) > 1 else ""
    return f"{what}: expected none, received a wait on an unfinished all-reduce in the hook of {blocked[0]}{more}: FAIL"


def _finished_verdict(label: str, step: dict, when: str) -> str:
    what = f"{label}: every all-reduce waited for {when}"
    left = int(step["in_flight_after_finish"])
    return f"{what}: PASS" if left == 0 else f"{what}: expected none in flight, received {left}: FAIL"


def judge_overlap(data) -> list[str]:
    reference = _reference("overlap")
    lines = []
    for c, (ranks, up_first) in enumerate(zip(data["cases"], OVERLAP_UP_FIRST, strict=True)):
        builds = ", ".join(f"rank {r} {'up' if r in up_first else 'gate'} first" for r in range(len(ranks)))
        lines.append(f"case {c + 1}: {builds}")  # shown, not scored
        rebuilt = rebuilt_plan(CAP, 0 in up_first)  # rank 0's order, on every rank
        plans = {
            "step 1, the first plan": first_plan(checks_model(), CAP),
            "step 2, the rebuilt plan (rank 0's order)": rebuilt,
        }
        for r, res in enumerate(ranks):
            who = f"case {c + 1}, rank {r}"
            lines.append(
                compare(f"{who}: parameters after {OVERLAP_STEPS} steps", res["params"], reference["params"]).line
            )
            steps = res["steps"]
            for k, ((what, plan), step) in enumerate(zip(plans.items(), steps, strict=True)):
                calls = step["calls"]
                if k == 0:
                    calls, line = _agreement(who, step, len(ranks))
                    lines.append(line)
                lines.append(_bucket_verdict(who, calls, _bucket_bytes(plan), what))
                lines.append(_start_verdict(who, calls, step["passes"], plan, what, r in up_first))
            for k, step in enumerate(steps):
                lines.append(_blocked_verdict(f"{who}, step {k + 1}", step))
                lines.append(_finished_verdict(f"{who}, step {k + 1}", step, "by the end of finish()"))
    called = [name for ranks in data["cases"] for res in ranks for name in res["library"]]
    lines.append(library_line("OverlappedDP", called, "the library's data parallelism"))
    return lines


# ------------------------------------------------------------------ the prediction: one step's traffic


def step_traffic_theory() -> dict[str, float]:
    """Per step once the buckets are rebuilt (rank 0's order, on every rank: the prediction's case): the bytes of
    the buckets that can only start once backward has produced its last gradient, and on rank 0 and rank 1 the bytes
    of the buckets that are complete before they may start (an earlier bucket of the plan is not)."""
    up_first = TRAFFIC["up_first"]
    plan = rebuilt_plan(TRAFFIC["cap"], 0 in up_first)
    sizes = _bucket_bytes(plan)
    last = len(arrival_order()) - 1
    exposed = sum(size for size, start in zip(sizes, _starts(plan, 0 in up_first), strict=True) if start == last)

    def held_back(rank: int) -> int:
        done, start = _completes(plan, rank in up_first), _starts(plan, rank in up_first)
        return sum(size for size, d, s in zip(sizes, done, start, strict=True) if d < s)

    return {"exposed_bytes": exposed, "held_back_bytes_rank0": held_back(0), "held_back_bytes_rank1": held_back(1)}


THEORY = {"step_traffic": step_traffic_theory}  # what the prediction's judge scores against


def _library_step(batches, plan: list[list[str]], microbatches: int, up_first_ranks: tuple[int, ...]) -> dict:
    """Rank code: one step of parlab's bucketed DP (parlab.schemes.data_parallel.BucketedDP) given `plan`'s
    buckets, with M micro-batches; what it handed to all_reduce, and when each gradient of the last backward arrived
    (the calls made before its hook)."""
    from parlab.schemes.data_parallel import Bucket, BucketedDP

    world, r = dist.get_world_size(), dist.get_rank()
    model = _rank_model(up_first_ranks)  # this rank's build: some produce gate's gradient before up's
    watch = GradientWatch(model)
    dp = BucketedDP(model)  # its hooks call dp._grad_ready, which reads dp.buckets: given the plan's buckets
    named = dict(model.named_parameters())
    dp.buckets = [Bucket(k, names, [named[n] for n in names]) for k, names in enumerate(plan)]
    dp.bucket_of = {id(p): bucket for bucket in dp.buckets for p in bucket.params}
    x, y = batches[0]
    mine = _block((len(x) // world,) * world, r)
    x_r, y_r = _on_device(x[mine], y[mine])
    with probe.recording(keep_sent_data=False) as calls:
        watch.calls = calls
        for m, (x_m, y_m) in enumerate(zip(x_r.chunk(microbatches), y_r.chunk(microbatches), strict=True)):
            dp.sync = m == microbatches - 1
            (lab_loss(model(x_m), y_m) / microbatches).backward()
        dp.finish()
    return {"calls": _plain_calls(calls), "arrivals": watch.passes[-1]["arrivals"]}


def _measured_traffic(res: dict, plan: list[list[str]]) -> tuple[int, int]:
    """(bytes all-reduced from the last gradient's hook on, bytes of buckets started in a later hook than the one
    that completed them), from what one rank did."""
    names, made = [name for name, _ in res["arrivals"]], [m for _, m in res["arrivals"]]
    position = {name: i for i, name in enumerate(names)}
    allreduces = [(i, c["bytes"]) for i, c in enumerate(res["calls"]) if c["op"] == "allreduce"]
    exposed = sum(size for i, size in allreduces if i >= made[-1])
    held = 0
    for (i, size), bucket in zip(allreduces, plan, strict=False):
        started_in = max(j for j, m in enumerate(made) if m <= i)  # the hook in which the call was made
        held += size if started_in > max(position[name] for name in bucket) else 0
    return exposed, held


def collect_step_traffic(exposed_bytes, held_back_bytes_rank0, held_back_bytes_rank1) -> dict:
    world, m = TRAFFIC["P"], TRAFFIC["M"]
    batches = lab_batches(TIED, TRAFFIC["B"], 1, seed=3)  # one optimizer step
    plan = rebuilt_plan(TRAFFIC["cap"], 0 in TRAFFIC["up_first"])
    ranks = parlab.launch(_library_step, world, batches, plan, m, TRAFFIC["up_first"], **LAUNCH)
    (exposed, held0), (_, held1) = _measured_traffic(ranks[0], plan), _measured_traffic(ranks[1], plan)
    return {
        "predicted": [_number(v) for v in (exposed_bytes, held_back_bytes_rank0, held_back_bytes_rank1)],
        "measured": [float(exposed), float(held0), float(held1)],
        "library": list(WATCH.calls),
    }


def _number(value):
    """A prediction as plain data for the grader: a float if it is a number, else its repr (which FAILs)."""
    if isinstance(value, bool):
        return repr(value)
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def judge_step_traffic(data) -> list[str]:
    theory = step_traffic_theory()
    case = f"P={TRAFFIC['P']}, M={TRAFFIC['M']}, rebuilt buckets, per step"
    labels = {
        "exposed_bytes": "bytes whose all-reduce starts only with the last gradient",
        "held_back_bytes_rank0": "rank 0: bytes of buckets complete before they may start",
        "held_back_bytes_rank1": "rank 1: bytes of buckets complete before they may start",
    }
    lines = []
    for (name, label), predicted, measured in zip(labels.items(), data["predicted"], data["measured"], strict=True):
        lines += prediction_lines(f"{case}: {label}", predicted, theory[name], measured, rtol=0)
    lines.append(library_line("the prediction's cell", data["library"], "the library's data parallelism"))
    return lines


# ----------------------------------------------------------------------- 4 · gradient accumulation


def train_accumulating(
    token_dp, accumulation_step, batches, rows: tuple[int, ...], microbatches: int, up_first_ranks: tuple[int, ...]
) -> dict:
    """Rank code: data parallelism with your TokenDP and your accumulation_step, SGD on every rank. Rank r holds
    rows[r] rows of each padded global batch (x, y, mask: [B, T])."""
    model = _rank_model(up_first_ranks)  # the same weights on every rank (some: up before gate)
    gradients = GradientWatch(model)  # the check's: when each gradient arrives, when each backward pass ends
    handles = HandleWatch(gradients)  # the check's: which all-reduces are still in flight
    opt = make_optimizer(model.parameters(), "sgd", LR)
    mine = _block(rows, dist.get_rank())
    losses, steps = [], []
    with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as called, handles.watching():
        gradients.calls = calls
        dp = token_dp(model, CAP)
        for x, y, mask in batches:
            x_r, y_r, mask_r = _on_device(x[mine], y[mine], mask[mine])  # [b_r, T]: this rank's rows
            opt.zero_grad()
            first_call, first_pass = len(calls), len(gradients.passes)
            losses.append(float(accumulation_step(model, dp, x_r, y_r, mask_r, microbatches)))
            _, flying = handles.take()  # at the optimizer step
            steps.append(
                {
                    "calls": _plain_calls(calls[first_call:]),
                    "passes": gradients.since(first_pass, first_call),
                    "in_flight_after_finish": flying,
                }
            )
            opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = torch.tensor(losses, dtype=torch.float64)  # host: plain numbers back to the grader
    return {"losses": losses, "params": params, "steps": steps, "library": called}


def collect_training(token_dp, accumulation_step) -> dict:
    args = (token_dp, accumulation_step, ACC_BATCHES, ACC_ROWS, ACC_M, ACC_UP_FIRST)
    try:
        return {"ranks": list(parlab.launch(train_accumulating, DP_RANKS, *args, **LAUNCH))}
    except RankError as error:  # a rank raised (e.g. the lab model's forward on a micro-batch of 0 rows)
        return {"raised": error_summary(error)}


def judge_training(data) -> list[str]:
    if "raised" in data:
        what = "every rank ran accumulation_step to its end, each step"
        return [f"{what}: expected no error, received {data['raised']}: FAIL"]
    ranks, reference = data["ranks"], _reference("training")
    lines = []
    for r, res in enumerate(ranks):
        lines.append(compare(f"rank {r}: the loss it returned, each step", res["losses"], reference["losses"]).line)
        lines.append(compare(f"rank {r}: parameters after {ACC_STEPS} steps", res["params"], reference["params"]).line)
    plans = [first_plan(checks_model(), CAP), rebuilt_plan(CAP, 0 in ACC_UP_FIRST)]
    extra = 8 * MAX_EXTRA
    for r, res in enumerate(ranks):
        for k, (step, plan) in enumerate(zip(res["steps"], plans, strict=True)):
            what = f"step {k + 1}, " + ("the first plan" if k == 0 else "the rebuilt plan (rank 0's order)")
            calls = step["calls"]
            if k == 0:
                calls, line = _agreement(f"rank {r}", step, len(ranks))
                lines.append(line)
            lines.append(_bucket_verdict(f"rank {r}", calls, _bucket_bytes(plan), what, extra))
            lines.append(_start_verdict(f"rank {r}", calls, step["passes"], plan, what, r in ACC_UP_FIRST, extra))
        flying = [int(step["in_flight_after_finish"]) for step in res["steps"]]
        what = f"rank {r}, every step: every all-reduce waited for before the optimizer step"
        lines.append(
            f"{what}: PASS" if not any(flying) else f"{what}: expected none, received {flying} in flight: FAIL"
        )
    called = [name for res in ranks for name in res["library"]]
    lines.append(library_line("TokenDP, accumulation_step", called, "the library's data parallelism"))
    return lines
