"""Lab 05's checks: ZeRO written by the student for the labs' own model, on live ranks (see parlab/grading).

    part 1  zero1         ZeRO-1: flat shards, padded, under a dynamic loss scale, clipped, overflowed steps skipped
    part 2  zero2         ZeRO-2 with gradient accumulation under budgets of gradient memory (this file)
    part 3  zero3         ZeRO-3 with prefetching, for a lab model whose LM head is tied to its embedding
                          (lab05_zero3.py)
    predict owner_memory  optimizer memory of per-tensor ownership at scale, and where it stops falling
                          (lab05_owners.py)
    part 4  owners        ZeRO-1 with whole tensors owned by ranks, balanced by bytes, for LAMB (lab05_owners.py)

The model is parlab.core.lab_model's (RMSNorm, grouped-query attention, SwiGLU, no biases): parlab's ZeRO does
not run it in stage 3 (its LM head reads its weight without calling the head module, whose hooks gather it), and
the library has none of the parts' variants (its ZeRO-1 keeps no loss scale and does not clip; its ZeRO-2
has no budget; its prefetch lives in module hooks). Every collective the student's code makes is seen where it
reaches the process group (`recording`, lab05_recording.py) with its payload in parlab.core.comm's convention: an
all-gather hands in this rank's contribution, a reduce-scatter its whole input. Every call into the student's code
runs under parlab/grading/labs/guard.py's hook: a call into parlab's own ZeRO (`LIBRARY`) is a FAIL line naming
it (`adam_step`, which the lab hands out, is allowed).
"""

from __future__ import annotations

import gc
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn

import parlab
from parlab.core.lab_model import build_lab_model, lab_loss
from parlab.core.memory import tensor_bytes
from parlab.grading.labs import lab05_owners, lab05_zero3, run_check
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab05_owners import train_owners  # noqa: F401  (printed by the handout)
from parlab.grading.labs.lab05_recording import (
    SUMMED,
    _dtype_line,
    _is,
    _line,
    _scale,
    _shard,
    _verdict,
    one_thread,
    recording,
    tensors_line,
)
from parlab.grading.labs.lab05_setup import (
    BATCH2,
    BATCHES1,
    CFG,
    CONFIGS,
    GROWTH,
    LAUNCH,
    LIBRARY,
    LR,
    MAX_NORM,
    OVERFLOW,
    SCALE0,
    STEPS1,
    K,
    N,
    buckets_of,
    library_verdict,
)
from parlab.grading.labs.lab05_zero3 import lab_forward, uses_of  # noqa: F401  (printed by the handout)
from parlab.schemes.zero.stages import adam_step

# This lab's checks written in other files: the grader looks each one up here, then in these.
PARTS = (lab05_zero3, lab05_owners)

# parlab's own ZeRO (parlab/grading/labs/guard.py): the scheme, its lesson helpers and run, the pipeline's ZeRO.

# The predictions' theory, one home: each judge scores against these functions.
THEORY = {"owner_memory": lab05_owners.owner_memory_theory}

STRUCTURAL = {
    "zero1": "3 ranks, 6 Adam steps of the lab model from each rank's own rows under dynamic loss scaling (the loss "
    "multiplied by state['scale']), planted in one rank's scaled gradient (each in another rank's shard): an inf in "
    "step 3, a NaN in step 5, and in step 6 a finite value whose square overflows float64 while the unscaled "
    "gradient's does not: every rank returns [True, True, False, True, False, True] and scales each step's loss by "
    "GradScaler's scale (2^16, halved by a skipped step, doubled after 2 steps taken in a row); losses and "
    "parameters equal one device's recipe (GradScaler's: unscale, skip a step whose gradient holds an inf or a NaN, "
    "clip the unscaled whole-batch gradient to norm MAX_NORM as clip_grad_norm_ does, Adam's t counting the steps "
    "taken); "
    "each rank's master weights and Adam m are its [S] slices of one device's, zero-padded to N S (S = "
    "ceil(Psi/N)); a step taken changes the model's own parameters, a step skipped changes nothing (parameters, "
    "master, m, v); it holds K S bytes of optimizer state (single numbers aside); per step exactly one "
    "reduce-scatter of the padded gradient [N S], one or two all-reduces of one number each and, in a step taken, "
    "one all-gather of its [S] shard, nothing else, every buffer in the model's dtype; no call into parlab's ZeRO",
    "zero2": "3 ranks, one step of the lab model for each of three (M, budget): (3, 112,000), (2, 130,000), (6, "
    "76,000), whose best choices differ: each rank's gradient shards equal its slices of one device's mean gradient "
    "over the global batch, padding zero; no .grad left; the rank holds at most the budget at every gradient's "
    "arrival (live .grad, the step's earlier gradients still alive wherever kept, the object's attributes beside its "
    "shards) and after every backward (every tensor the process made since the object was built and still holds, "
    "from gc: a module-level stash counts); every call a "
    "reduce-scatter of one bucket's padded gradient [N S_b]: in each micro-batch but the last the same buckets, in "
    "the order backward completes them, in the last every bucket; the step's reduce-scatter payload the least any "
    "choice of buckets within the budget allows (the judge's search over every choice, memory replayed gradient by "
    "gradient); no call into parlab's ZeRO",
    "zero3": "3 ranks, the tied lab model (one block) with every matrix held as [S] shards and the student's "
    "Prefetcher shared by every use: each rank's logits and gradient shards equal one device's (the tied matrix's "
    "gradient from both its uses); forward: one all-gather per use of a matrix, in order (the tied one twice); "
    "backward: one all-gather per use of a matrix in a product and none for the lookup, one reduce-scatter per use; "
    "from parlab.core.comm's trace and the times each use's Function ran (forward and backward): each all-gather "
    "but the first of each phase issued during the previous use's call and waited for during its own; the bytes "
    "of gathered weights alive as each all-gather returns exactly the matrix just gathered plus the one of the use "
    "computing (none more); none alive after forward or backward; nothing but inputs and shards kept for "
    "backward; no call into parlab's ZeRO",
    "owner_memory": "for a Llama-3-8B-like model with GQA (K = 12), exactly: the optimizer bytes per rank of flat "
    "ZeRO-1 on 64 ranks, the busiest rank's under the best per-tensor ownership on 64 ranks, and the fewest ranks "
    "from which more ranks no longer lower the latter (the judge's own search)",
    "owners": "the owners your assignment gives (for the lab model on 3 and 4 ranks and five lists of sizes, two of "
    "them where largest-first-to-the-least-loaded is not optimal): every tensor owned by one rank, the busiest rank "
    "owning as few elements as any assignment allows (the judge's exhaustive search); 3 ranks, 2 LAMB steps of the "
    "lab model: parameters equal one device's; each rank holds Adam's m and v of the tensors it owns only; per step "
    "every collective a reduce to an owner or a broadcast from one, in any order, each owner receiving (and "
    "sending) exactly the bytes of the tensors it owns, nothing else; no call into parlab's ZeRO",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def my_rows(x: torch.Tensor, y: torch.Tensor, r: int, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's b = B/P rows of a global batch [B, T], on this rank's device."""
    b = len(x) // P
    return x[r * b : (r + 1) * b].to(parlab.device()), y[r * b : (r + 1) * b].to(parlab.device())


# ---------------------------------------------------------------------------------------- part 1: ZeRO-1


def flat_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The lab model whose parameters and gradients are views of two flat buffers of Psi numbers (not padded):
    flat_param (writing it writes the parameters) and flat_grad (backward accumulates into it)."""
    model = build_lab_model(CFG, seed=0, device=parlab.device())  # the same weights on every rank
    flat_param = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # [Psi]
    flat_grad = torch.zeros_like(flat_param)  # [Psi]
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.data = flat_param[offset : offset + n].view_as(p)
        p.grad = flat_grad[offset : offset + n].view_as(p)
        offset += n
    return model, flat_param, flat_grad


def train_zero1(init_shard, zero1_step, batches) -> dict:
    """Rank code: ZeRO-1 with your two functions. batches: the global batches, the same list on every rank. Each
    step's loss is multiplied by your state["scale"]; in the steps of OVERFLOW one rank's scaled gradient holds an
    inf, a NaN (an fp16 overflow) or a huge finite number, planted here."""
    P, r = dist.get_world_size(), dist.get_rank()
    model, flat_param, flat_grad = flat_model()
    with library_calls(LIBRARY) as called:
        state = init_shard(flat_param)  # rank r's master weights, m, v (and whatever else you keep)
    losses, calls, dtypes, stepped, moved, scales = [], [], set(), [], [], []
    for step, (x, y) in enumerate(batches, start=1):
        flat_grad.zero_()
        x_r, y_r = my_rows(x, y, r, P)  # [B/N, T]
        loss = lab_loss(model(x_r), y_r)  # the mean over this rank's rows
        scales.append(float(state["scale"]))
        (loss * state["scale"]).backward()  # flat_grad <- scale x the gradient of this rank's rows [Psi]
        if step in OVERFLOW and OVERFLOW[step][0] == r:  # planted in this rank's scaled gradient
            flat_grad[OVERFLOW[step][1]] = OVERFLOW[step][2]
        before = [_params_of(model), *(state[k].detach().clone() for k in ("master", "m", "v"))]
        with recording() as seen, library_calls(LIBRARY) as more:
            took = zero1_step(flat_param, flat_grad, state)
        called += [c for c in more if c not in called]
        after = [_params_of(model), *(state[k] for k in ("master", "m", "v"))]
        moved.append([not a.equal(b) for a, b in zip(after, before, strict=True)])
        stepped.append(took if isinstance(took, bool) else repr(took)[:40])
        losses.append(loss.item())
        calls.append(seen.calls)
        dtypes |= seen.dtypes
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),  # host: plain numbers for the grader
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "master": state["master"].detach().clone(),
        "m": state["m"].detach().clone(),
        "held": tensor_bytes([t for t in _tensors_in(state) if t.numel() > 1]),  # a counter or a flag aside
        "calls": calls,
        "dtypes": sorted(dtypes),
        "stepped": stepped,  # what zero1_step returned in each step
        "scales": scales,  # the scale each step's loss was multiplied by
        "moved": moved,  # per step: did [the model's parameters, master, m, v] change
        "library": list(called),
    }


def _params_of(model: nn.Module) -> torch.Tensor:
    """The parameters the model computes with, flat: [Psi] (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def single_device_adam(batches) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor, list[bool], list]:
    """The reference: one device, the whole batch, torch's recipe on all Psi parameters at once (GradScaler's
    unscale_, clip_grad_norm_, step, update): a step whose unscaled gradient holds an inf or a NaN is skipped (the
    optimizer never sees it) and halves the scale; the others clip the unscaled gradient to norm MAX_NORM
    (torch.nn.utils.clip_grad_norm_'s arithmetic) and take Adam's step (adam_step is torch.optim.Adam's
    arithmetic, checked against it in tests/test_zero.py; torch.optim would import torch._dynamo, seconds of this
    notebook's budget); GROWTH steps taken in a row double the scale. Multiplying the loss by a power of two scales
    every gradient exactly, so the reference runs unscaled and plants each value as the ranks' mean of it would
    arrive unscaled. Returns the loss of each step, the final parameters, Adam's m [Psi], which steps were taken and
    the scale of each step."""
    model = build_lab_model(CFG, seed=0)
    params = list(model.parameters())
    master = torch.cat([p.detach().reshape(-1) for p in params])  # [Psi]
    m, v, losses, taken = torch.zeros_like(master), torch.zeros_like(master), [], []
    scale, in_a_row, scales = SCALE0, 0, []
    for step, (x, y) in enumerate(batches, start=1):
        model.zero_grad(set_to_none=True)
        loss = lab_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        scales.append(scale)
        grad = torch.cat([p.grad.reshape(-1) for p in params])  # [Psi] the whole batch's
        if step in OVERFLOW:  # one rank's scaled gradient holds it: the mean over N ranks, unscaled
            grad[OVERFLOW[step][1]] = OVERFLOW[step][2] / N / scale
        taken.append(bool(torch.isfinite(grad).all()))  # GradScaler's found_inf, from the unscaled gradient
        if not taken[-1]:
            scale, in_a_row = scale / 2, 0
            continue
        in_a_row += 1
        if in_a_row == GROWTH:
            scale, in_a_row = scale * 2, 0
        grad *= torch.clamp(MAX_NORM / (grad.norm() + 1e-6), max=1.0)
        adam_step(master, grad, m, v, sum(taken), LR)  # Adam's t: the steps taken so far
        torch.nn.utils.vector_to_parameters(master, params)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, m, taken, scales


def collect_zero1(init_shard, zero1_step) -> dict:
    return {"ranks": list(parlab.launch(train_zero1, N, init_shard, zero1_step, BATCHES1, **LAUNCH))}


def judge_zero1(data) -> list[str]:
    ranks = data["ranks"]
    with one_thread():
        losses, params, m, taken, scales = single_device_adam(BATCHES1)
    psi = sum(t.numel() for t in params.values())
    S = -(-psi // N)
    flat = torch.cat([t.reshape(-1) for t in params.values()])
    mean_loss = torch.stack([res["losses"] for res in ranks]).mean(dim=0)  # each rank's loss is over B/N rows
    lines = [
        library_verdict("zero1", [c for res in ranks for c in res["library"]]),
        _dtype_line(ranks),
        _first_wrong(
            "what zero1_step returned in each step (True: it updated the parameters)",
            [(f"rank {r}", res["stepped"]) for r, res in enumerate(ranks)],
            taken,
        ),
        _first_wrong(
            "the scale each step's loss was multiplied by (state['scale'])",
            [(f"rank {r}", res["scales"]) for r, res in enumerate(ranks)],
            scales,
        ),
        _moved_line(ranks, taken),
        _scaled_line(
            "every rank's Adam m: its slice of one device's m, zero-padded",
            [{"m": res["m"]} for res in ranks],
            [{"m": _shard(m, r, N)} for r in range(N)],
        ),
        tensors_line(
            "loss of each step, averaged over ranks",
            [{"the loss of each step": mean_loss}],
            [{"the loss of each step": torch.tensor(losses, dtype=torch.float64)}],  # host: the reference
            who=["the mean over ranks"],
        ),
        tensors_line(f"every rank's parameters after {STEPS1} steps", [res["params"] for res in ranks], [params] * N),
        tensors_line(
            "every rank's master weights: its slice of the parameters, zero-padded to N S",
            [{"master": res["master"]} for res in ranks],
            [{"master": _shard(flat, r, N)} for r in range(N)],
        ),
        _line("optimizer bytes each rank holds (K S)", [res["held"] for res in ranks], [K * S] * N),
    ]
    lines.append(_calls_line(ranks, taken, S))
    return lines


def _calls_line(ranks: list[dict], taken: list[bool], S: int) -> str:
    """Each step's collectives, in any order: one reduce-scatter of [N S], one or two all-reduces of one number, and
    one all-gather of [S] in a step taken; nothing else."""
    what = "collectives [op, payload bytes] of each step (in any order)"

    def allowed(took: bool, reduces: int) -> list:
        calls = [["reduce_scatter", N * S * 8], *[["all_reduce", 8]] * reduces, *([["all_gather", S * 8]] * took)]
        return sorted(calls)

    for r, res in enumerate(ranks):
        if len(res["calls"]) != len(taken):
            return f"{what}: rank {r}: expected {len(taken)} steps, received {len(res['calls'])}: FAIL"
        for step, (calls, took) in enumerate(zip(res["calls"], taken, strict=True), start=1):
            if sorted(calls) not in (allowed(took, 1), allowed(took, 2)):
                return (
                    f"{what}: rank {r}, step {step}: expected {allowed(took, 1)} with one or two all-reduces of 8 "
                    f"bytes, received {calls}: FAIL"
                )
    return f"{what}: a reduce-scatter, one or two all-reduces of one number, an all-gather in a step taken: PASS"


def _first_wrong(what: str, got: list[tuple[str, list]], expected: list) -> str:
    """One verdict on per-step lists (got: (who, its list)): PASS when every one equals `expected`, else a FAIL
    line naming the first who and step with what was expected and what came."""
    for who, items in got:
        for step, want in enumerate(expected, start=1):
            have = items[step - 1] if isinstance(items, list) and step <= len(items) else "nothing"
            if have != want:
                return f"{what}: {who}, step {step}: expected {want}, received {have}: FAIL"
        if isinstance(items, list) and len(items) != len(expected):
            return f"{what}: {who}: expected {len(expected)} steps, received {len(items)}: FAIL"
    return f"{what}: {expected} on every rank: PASS"


def _moved_line(ranks: list[dict], taken: list[bool]) -> str:
    """A step taken changed the model's own parameters and the master weights; a step skipped changed nothing (not
    the parameters, nor master, m, v)."""
    what = "every step taken changed the model's own parameters, every step skipped changed nothing, on every rank"
    names = ["the model's parameters", "master", "m", "v"]
    for r, res in enumerate(ranks):
        for step, (changed, took) in enumerate(zip(res["moved"], taken, strict=True), start=1):
            if took and not any(changed):
                return f"{what}: rank {r}, step {step} (taken): nothing changed, as if the step were skipped: FAIL"
            if took and not changed[0]:
                why = "the master weights changed but " if changed[1] else ""
                return (
                    f"{what}: rank {r}, step {step} (taken): {why}the model's parameters did not change (flat_param "
                    "must be written in place: the model's parameters are views of it): FAIL"
                )
            if not took and any(changed):
                moved = [n for n, c in zip(names, changed, strict=True) if c]
                return (
                    f"{what}: rank {r}, step {step} (skipped): expected nothing changed, received {moved} changed: FAIL"
                )
    return f"{what}: PASS"


def _scaled_line(what: str, got: list, expected: list, who: list[str] | None = None, micro: list[int] | None = None):
    """tensors_line; when every entry's tensors are a multiple of one device's, a FAIL line naming the multiple (N:
    summed over ranks; M: summed over micro-batches; M N: both). micro: each entry's M (part 2)."""
    line = tensors_line(what, got, expected, who=who)
    if line.endswith(": PASS"):
        return line
    scales = [_scale([g.get(k) for k in e], list(e.values())) for g, e in zip(got, expected, strict=True)]
    if all(_is(c, N) for c in scales):
        return f"{what}: every rank's is N = {N} times one device's (to 0.1%): {SUMMED}: FAIL"
    if micro and all(_is(c, M) for c, M in zip(scales, micro, strict=True)):
        return (
            f"{what}: every rank's is M times one device's (to 0.1%), M the micro-batches of its step: the "
            "micro-batches' gradients were summed; the step's gradient is their mean: FAIL"
        )
    if micro and all(_is(c, M * N) for c, M in zip(scales, micro, strict=True)):
        both = "summed over micro-batches and ranks"
        return (
            f"{what}: every rank's is M N times one device's (to 0.1%), M the micro-batches of its step: {both}: FAIL"
        )
    return line


# ------------------------------------------------------------- part 2: ZeRO-2, accumulation under a budget


def _storage(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def _skipped(params: list[nn.Parameter], yours) -> set[tuple]:
    """The storages no count of full gradients includes: the parameters' and your object's shards'."""
    skip = {_storage(p) for p in params}
    if yours is not None:
        skip |= {_storage(t) for t in _tensors_in(getattr(yours, "shards", []))}
    return skip


def _held_gradients(params: list[nn.Parameter], yours, landed: list) -> int:
    """Bytes of full gradients this rank holds now: every live .grad, every gradient that landed earlier in this
    step and is still alive wherever it is kept (landed: weak references to their storages), and every tensor your
    object keeps in its attributes (lists and dicts of them too) but its shards and the parameters themselves; a
    storage counted once."""
    kept = _tensors_in({k: v for k, v in vars(yours).items() if k != "shards"}) if yours is not None else []
    storages = [_storage(t) for t in [p.grad for p in params if p.grad is not None] + kept]
    for ref in landed:
        if not ref.expired():
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            storages.append((storage.data_ptr(), storage.nbytes()))
    skip = _skipped(params, yours)
    return sum(nbytes for ptr, nbytes in set(storages) - skip)


def _live_storages() -> dict[int, object]:
    """Every storage a Python tensor of this process refers to (gc's view): {data_ptr: a weak reference to it}."""
    from torch.multiprocessing.reductions import StorageWeakRef

    live = {}
    for t in gc.get_objects():
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            live[t.untyped_storage().data_ptr()] = StorageWeakRef(t.untyped_storage())
    return live


def _made_since(before: dict[int, object], skip: set[tuple]) -> int:
    """Bytes of the storages Python tensors of this process refer to now that were not alive in `before`
    (_live_storages's), `skip` aside: whatever the step made and still holds, in any object or module."""
    total = 0
    for ptr, ref in _live_storages().items():
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        old = before.get(ptr)
        if (old is None or old.expired()) and (ptr, storage.nbytes()) not in skip:
            total += storage.nbytes()
    return total


def _tensors_in(value, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples, sets and dicts (not in other objects)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set)):
        return [t for item in value for t in _tensors_in(item, depth + 1)]
    return []


def run_zero2(Zero2Accumulate, x, y) -> dict:
    """Rank code: for each (M, budget) of CONFIGS, one step of the lab model (fresh, the same weights) in M
    micro-batches of this rank's rows, with your gradient hooks. What the rank holds is measured as each gradient
    lands (the gradients of this step still alive, your object's attributes) and after each backward (every tensor
    of the process made since your object was built and still alive, wherever it is kept)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    P, r = dist.get_world_size(), dist.get_rank()
    x_r, y_r = my_rows(x, y, r, P)  # [b, T], b = B2/N rows
    out, called = [], []
    for M, budget in CONFIGS:
        model = build_lab_model(CFG, seed=0, device=parlab.device())
        params, names = list(model.parameters()), {id(p): n for n, p in model.named_parameters()}
        yours, held, micro, landed = [], [], [0], []

        def observe(p, yours=yours, held=held, micro=micro, params=params, names=names, landed=landed):
            # runs before your hook of the same parameter: what this rank holds as p's gradient lands
            held.append([_held_gradients(params, yours[0] if yours else None, landed), micro[0], names[id(p)]])
            landed.append(StorageWeakRef(p.grad.untyped_storage()))

        for p in params:
            p.register_post_accumulate_grad_hook(observe)
        before = _live_storages()  # what the process held before your object was built
        with library_calls(LIBRARY) as more:
            yours.append(Zero2Accumulate(buckets_of(model), M, budget))
        called += [c for c in more if c not in called]
        per_micro = []
        with recording() as seen, library_calls(LIBRARY) as more:
            for k, (x_k, y_k) in enumerate(zip(x_r.chunk(M), y_r.chunk(M), strict=True)):  # [b/M, T] each
                micro[0] = yours[0].micro_batch = k
                start = len(seen.calls)
                lab_loss(model(x_k), y_k).backward()  # the mean over this micro-batch's rows
                per_micro.append(seen.calls[start:])
                held.append([_made_since(before, _skipped(params, yours[0])), k, None])
        called += [c for c in more if c not in called]
        most = max(nbytes for nbytes, _, _ in held)
        out.append(
            {
                "shards": [s.detach().clone() for s in yours[0].shards],
                "calls": per_micro,
                "dtypes": sorted(seen.dtypes),
                "grads_after": tensor_bytes([p.grad for p in params if p.grad is not None]),
                "peak": next(h for h in held if h[0] == most),  # [bytes, micro-batch, the gradient that had landed]
            }
        )
    return {"configs": out, "library": called}


def collect_zero2(Zero2Accumulate) -> dict:
    return {"ranks": list(parlab.launch(run_zero2, N, Zero2Accumulate, *BATCH2, **LAUNCH))}


def bucket_names(model: nn.Module) -> list[str]:
    """Each bucket of buckets_of by the module its first parameter belongs to: "embed", "blocks.0.attn" (its
    attn_norm and attention), "blocks.0.mlp" (its mlp_norm and MLP), ..., "norm" (with the head)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for bucket in buckets_of(model):
        module = names[id(bucket[0])].rsplit(".", 1)[0]  # e.g. blocks.0.attn_norm
        out.append(module.replace("_norm", ""))  # blocks.0.attn_norm -> blocks.0.attn
    return out


def arrival_order(model: nn.Module, loss: torch.Tensor) -> list[nn.Parameter]:
    """The parameters in the order backward accumulates their gradients (the same on every rank: the same graph)."""
    order = []
    hooks = [p.register_post_accumulate_grad_hook(order.append) for p in model.parameters()]
    loss.backward()
    for hook in hooks:
        hook.remove()
    return order


def held_peak(order: list[int], sizes: list[int], bucket_of: list[int], resident: set[int], micro: int) -> int:
    """The most elements of full gradients alive at a gradient's arrival, over `micro` backwards, when the buckets in
    `resident` keep their gradients until the last backward and every other bucket drops its own as soon as it is
    complete. order: parameter indices in arrival order; sizes: their numels; bucket_of: their buckets."""
    alive, peak = {}, 0
    for k in range(micro):
        waiting = {b: bucket_of.count(b) for b in set(bucket_of)}
        for i in order:
            alive[i] = sizes[i]
            peak = max(peak, sum(alive.values()))
            b = bucket_of[i]
            waiting[b] -= 1
            if waiting[b] == 0 and (b not in resident or k == micro - 1):
                for j in [j for j in alive if bucket_of[j] == b]:
                    del alive[j]
    return peak


def best_choices(order, sizes, bucket_of, payloads: list[int], budget: int, M: int) -> tuple[int, list[set[int]]]:
    """The least reduce-scatter payload of a step of M micro-batches within the budget (bytes of float64 full
    gradients), and every set of resident buckets that reaches it. A resident bucket is reduced once per step, the
    others M times."""
    best, sets = None, []
    for n in range(len(payloads) + 1):
        for chosen in itertools.combinations(range(len(payloads)), n):
            resident = set(chosen)
            if 8 * held_peak(order, sizes, bucket_of, resident, M) > budget:
                continue
            cost = sum(p * (1 if b in resident else M) for b, p in enumerate(payloads))
            if best is None or cost < best:
                best, sets = cost, [resident]
            elif cost == best:
                sets.append(resident)
    return best, sets


def _config(M: int, budget: int) -> str:
    return f"M = {M}, budget {budget:,}"


def judge_zero2(data) -> list[str]:
    ranks = data["ranks"]
    model = build_lab_model(CFG, seed=0)
    with one_thread():
        order = arrival_order(model, lab_loss(model(BATCH2[0]), BATCH2[1]))  # the mean over all B2 rows
    buckets = buckets_of(model)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    bucket_of = [next(b for b, bucket in enumerate(buckets) if any(q is p for q in bucket)) for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    arrivals = [index[id(p)] for p in order]
    completed = []  # buckets in the order backward completes them
    for i in arrivals:
        if all(index[id(q)] in arrivals[: arrivals.index(i) + 1] for q in buckets[bucket_of[i]]):
            if bucket_of[i] not in completed:
                completed.append(bucket_of[i])
    numels = [sum(p.numel() for p in bucket) for bucket in buckets]  # Psi_b
    payloads = [8 * N * -(-n // N) for n in numels]  # a reduce-scatter's input [N S_b], float64
    named = bucket_names(model)
    expected = {
        named[b]: torch.cat([p.grad.reshape(-1) for p in bucket]) for b, bucket in enumerate(buckets)
    }  # the mean gradient, the same whatever M
    got, want, who, micro = [], [], [], []
    for c, (M, budget) in enumerate(CONFIGS):
        for r, res in enumerate(ranks):
            got.append(dict(zip(named, res["configs"][c]["shards"], strict=False)))
            want.append({n: _shard(g, r, N) for n, g in expected.items()})
            who.append(f"{_config(M, budget)}, rank {r}")
            micro.append(M)
    lines = [
        library_verdict("zero2", [c for res in ranks for c in res["library"]]),
        _dtype_line([{"dtypes": sorted({d for c in res["configs"] for d in c["dtypes"]})} for res in ranks]),
        _scaled_line(
            "every rank's gradient shards: its slices of the mean gradient, zero-padded", got, want, who, micro
        ),
    ]
    left = [
        (f"{_config(M, budget)}, rank {r}", res["configs"][c]["grads_after"])
        for c, (M, budget) in enumerate(CONFIGS)
        for r, res in enumerate(ranks)
        if res["configs"][c]["grads_after"]
    ]
    lines.append(
        _verdict(
            not left,
            "no parameter has a .grad after the last backward, on any rank",
            f"{left[0][0]}: expected no .grad after the last backward, received {left[0][1]:,} bytes of .grad"
            if left
            else "",
        )
    )
    lines.append(_budget_line(ranks))
    pattern, least_wrong, same = [], [], []
    for c, (M, budget) in enumerate(CONFIGS):
        mine = ranks[0]["configs"][c]
        line = _pattern_line(mine["calls"], [payloads[b] for b in completed], M)
        if line.endswith(": FAIL") and not pattern:
            pattern.append(f"{_config(M, budget)}: {line}")
        least, _ = best_choices(arrivals, sizes, bucket_of, payloads, budget, M)
        total = sum(nbytes for calls in mine["calls"] for _, nbytes, *_ in calls)
        if total != least and not least_wrong:
            least_wrong.append(
                f"{_config(M, budget)}: measured {total:,} bytes; the least any choice of buckets within the budget "
                f"allows: {least:,}"
            )
        for r, res in enumerate(ranks[1:], start=1):
            if res["configs"][c]["calls"] != mine["calls"] and not same:
                same.append(
                    f"{_config(M, budget)}: rank {r}: expected {mine['calls']}, received {res['configs'][c]['calls']}"
                )
    what = "rank 0's reduce-scatters: one per bucket, in the order backward completes them"
    lines += [
        pattern[0]
        if pattern
        else f"{what}; the same buckets in each micro-batch but the last, every bucket in the last, for every (M, "
        "budget): PASS",
        _verdict(
            not least_wrong,
            "reduce-scatter payload of rank 0's step, for every (M, budget): the least any choice of buckets within "
            "the budget allows",
            f"reduce-scatter payload of rank 0's step: {least_wrong[0] if least_wrong else ''}",
        ),
        _verdict(
            not same, f"ranks 1-{N - 1}: the same collectives as rank 0", f"ranks 1-{N - 1}: {same[0] if same else ''}"
        ),
    ]
    return lines


def _budget_line(ranks: list[dict]) -> str:
    what = "full gradients each rank holds as each gradient lands and after each backward: at most the budget"
    for c, (M, budget) in enumerate(CONFIGS):
        for r, res in enumerate(ranks):
            nbytes, micro, name = res["configs"][c]["peak"]
            if nbytes > budget:
                when = (
                    f"after the backward of micro-batch {micro}"
                    if name is None
                    else (f"when {name}'s gradient landed in micro-batch {micro}")
                )
                return f"{what}: {_config(M, budget)}: rank {r} held {nbytes:,} bytes {when}: FAIL"
    return f"{what}, for every (M, budget): PASS"


def _pattern_line(calls: list[list], everything: list[int], M: int) -> str:
    """Rank 0's reduce-scatters per micro-batch: the same buckets in every micro-batch but the last, some of the
    buckets in the order backward completes them; every bucket, in that order, in the last."""
    what = "rank 0's reduce-scatters: one per bucket, in the order backward completes them"
    first = [nbytes for _, nbytes, *_ in calls[0]] if calls else []
    if len(calls) != M:
        return f"{what}: expected {M} micro-batches, received {len(calls)}: FAIL"
    for k, micro in enumerate(calls):
        others = sorted({op for op, *_ in micro} - {"reduce_scatter"})
        got, last = [nbytes for _, nbytes, *_ in micro], k == len(calls) - 1
        if others:
            return f"{what}: micro-batch {k} also called {others}: FAIL"
        if last and got != everything:
            return f"{what}: the last micro-batch: expected every bucket's payload {everything}, received {got}: FAIL"
        if not last and not _subsequence(got, everything):
            return f"{what}: micro-batch {k}: expected payloads among {everything}, in that order, received {got}: FAIL"
        if not last and got != first:
            return f"{what}: micro-batch {k}: expected the buckets of micro-batch 0 {first}, received {got}: FAIL"
    return f"{what}: PASS"


def _subsequence(part: list, whole: list) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)
