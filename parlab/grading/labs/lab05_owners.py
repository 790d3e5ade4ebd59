"""Lab 05's last prediction and part: ZeRO-1 with whole tensors owned by ranks (the checks owner_memory, owners).

A flat split (parts 1-3, parlab's ZeRO) cuts tensors anywhere; an optimizer that needs a whole tensor (LAMB's
trust ratio ||w|| / ||u||, Shampoo's or Muon's matrix steps) cannot run on such a piece without more communication.
Per-tensor ownership gives every tensor to one rank, which keeps that tensor's optimizer state and steps it whole:
the gradient is reduced to the owner, the updated tensor broadcast from it. What it costs is balance: the owners
must share the bytes as evenly as whole tensors allow. PyTorch's ZeroRedundancyOptimizer shards this way; parlab's
ZeRO does not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.core.lab_model import build_lab_model, lab_loss
from parlab.grading.labs import prediction_lines
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab05_recording import _dtype_line, one_thread, recording, tensors_line
from parlab.grading.labs.lab05_setup import BATCHES, CFG, LAUNCH, LIBRARY, LR, STEPS, N, lamb_step, library_verdict

# ----------------------------------------------------------------------------------- the best busiest rank


def busiest(numels: list[int], owners: list[int], P: int) -> int:
    """Elements owned by the busiest of P ranks."""
    loads = [0] * P
    for n, q in zip(numels, owners, strict=True):
        loads[q] += n
    return max(loads)


def best_busiest(numels: list[int], P: int) -> int:
    """The fewest elements the busiest rank can own when every tensor goes whole to one of P ranks (the judge's
    own search: largest first to the least loaded rank, proved optimal by the lower bound max(largest, ceil(total/P)),
    else an exhaustive search over distinct load profiles, largest tensors first)."""
    sizes = sorted(numels, reverse=True)
    bound = max(sizes[0], -(-sum(sizes) // P))
    loads = [0] * P
    for n in sizes:
        loads[loads.index(min(loads))] += n
    best = max(loads)
    if best == bound:
        return best
    seen: set = set()

    def search(i: int, loads: tuple[int, ...]) -> None:
        nonlocal best
        if max(loads) >= best or (i, loads) in seen:
            return
        seen.add((i, loads))
        if i == len(sizes):
            best = max(loads)
            return
        for q in sorted(set(range(P)), key=lambda q: loads[q]):
            if loads[q] in loads[:q]:  # a rank with the same load as an earlier one: the same profile
                continue
            search(i + 1, tuple(sorted(loads[:q] + (loads[q] + sizes[i],) + loads[q + 1 :])))
            if best == bound:
                return

    search(0, (0,) * P)
    return best


# ----------------------------------------------------------------------------------- the prediction

# A Llama-3-8B-like model (Grattafiori et al. 2024): GQA with 8 key/value heads for 32 query heads, SwiGLU, RMSNorm,
# no biases, an untied LM head; the lab model's layout at scale.
LLAMA = {"vocab": 128_256, "hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14_336}
OWNER_N, OWNER_K = 64, 12  # ranks; bytes of optimizer state per parameter (fp32 master weight, Adam m and v)


def llama_numels() -> list[int]:
    """The model's tensors' sizes, in the lab model's order (embed, per block: attn_norm, q, k, v, o, mlp_norm,
    gate, up, down; norm, head)."""
    V, H, L, F = LLAMA["vocab"], LLAMA["hidden"], LLAMA["layers"], LLAMA["ffn"]
    kv = LLAMA["kv_heads"] * H // LLAMA["heads"]  # rows of k and of v: nkv * hd
    block = [H, H * H, kv * H, kv * H, H * H, H, F * H, F * H, H * F]
    return [V * H, *block * L, H, V * H]


def owner_memory_theory() -> dict[str, float]:
    """The optimizer bytes per rank of flat ZeRO-1 on OWNER_N ranks (K ceil(Psi/N)); the busiest rank's under the
    best per-tensor ownership on OWNER_N ranks (K times the fewest elements the busiest rank can own); and the fewest
    ranks at which that busiest rank's bytes reach their floor, so that no number of ranks beyond lowers them.

    The floor is the largest tensor (no rank owns less than a whole tensor it owns, and one rank owns the largest):
    below ceil(Psi / largest) ranks the average load exceeds it; from there on, the judge's search tells whether the
    other tensors fit beside it."""
    numels = llama_numels()
    largest = max(numels)
    floor_ranks = -(-sum(numels) // largest)  # fewer ranks: the average, hence the busiest, exceeds the largest
    while best_busiest(numels, floor_ranks) > largest:
        floor_ranks += 1
    return {
        "flat_bytes": OWNER_K * -(-sum(numels) // OWNER_N),
        "owner_bytes": OWNER_K * best_busiest(numels, OWNER_N),
        "floor_ranks": floor_ranks,
    }


def collect_owner_memory(flat_bytes, owner_bytes, floor_ranks) -> dict:
    return {"predicted": [_plain(flat_bytes), _plain(owner_bytes), _plain(floor_ranks)]}


def _plain(value):
    """A prediction as plain data for the grader (a number stays a number; anything else its text)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return value if isinstance(value, (int, float)) else repr(value)[:80]


def judge_owner_memory(data) -> list[str]:
    theory = owner_memory_theory()
    flat, owner, floor = data["predicted"]
    return [
        *prediction_lines(
            f"optimizer bytes per rank, flat ZeRO-1, {OWNER_N} ranks", flat, theory["flat_bytes"], rtol=0
        ),
        *prediction_lines(
            f"optimizer bytes of the busiest rank, per-tensor owners, {OWNER_N} ranks",
            owner,
            theory["owner_bytes"],
            rtol=0,
        ),
        *prediction_lines(
            "the fewest ranks from which more ranks no longer lower the busiest owner's bytes",
            floor,
            theory["floor_ranks"],
            rtol=0,
        ),
    ]


# ----------------------------------------------------------------------------------- part 4: owners

# assign_owners's cases beside the lab model on N ranks: (what, sizes, ranks)
CASES = [
    ("the lab model", None, 4),
    ("[1, 1, 2, 2, 3, 3, 4]", [1, 1, 2, 2, 3, 3, 4], 3),
    ("[10, 1, 1, 1, 1]", [10, 1, 1, 1, 1], 3),
    ("[5, 3]", [5, 3], 3),
    ("[5, 5, 4, 4, 3, 3, 3]", [5, 5, 4, 4, 3, 3, 3], 3),
    ("[352, 320, 160, 320, 256, 288, 224, 256, 224]", [352, 320, 160, 320, 256, 288, 224, 256, 224], 4),
]


def lab_numels() -> list[int]:
    return [p.numel() for p in build_lab_model(CFG).parameters()]


def _as_owners(value, count: int, P: int) -> list[int] | str:
    """An answer as a list of owners, or what was wrong with it."""
    try:
        owners = [int(q) for q in value]
    except (TypeError, ValueError):
        return f"not a list of ranks: {type(value).__name__}"
    if len(owners) != count:
        return f"{len(owners)} owners for {count} tensors"
    if any(not 0 <= q < P for q in owners):
        return f"an owner outside 0..{P - 1}: {sorted(set(owners))}"
    return owners


def train_owners(assign_owners, init_owned, owner_step, batches, library: tuple) -> dict:
    """Rank code: the lab model trained with LAMB, each tensor stepped whole by its owner (your three functions)."""
    P, r = dist.get_world_size(), dist.get_rank()
    model = build_lab_model(CFG, seed=0, device=parlab.device())  # the same weights on every rank
    params = list(model.parameters())
    with library_calls(library) as called:
        owners = assign_owners([p.numel() for p in params], P)
        owners = [int(q) for q in owners]
        state = init_owned(params, owners)
    calls, dtypes = [], set()
    for step, (x, y) in enumerate(batches, start=1):
        model.zero_grad(set_to_none=True)
        b = len(x) // P
        x_r, y_r = x[r * b : (r + 1) * b].to(parlab.device()), y[r * b : (r + 1) * b].to(parlab.device())
        lab_loss(model(x_r), y_r).backward()  # p.grad <- the gradient of the mean over this rank's rows
        with recording() as seen, library_calls(library) as more:
            owner_step(params, owners, state, step)
        called += [c for c in more if c not in called]
        calls.append(seen.calls)
        dtypes |= seen.dtypes
    skip = {p.untyped_storage().data_ptr() for p in params}
    held = {}
    for t in _tensors_of(state):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            held[ptr] = t.untyped_storage().nbytes()
    return {
        "owners": owners,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "held": sum(held.values()),
        "calls": calls,
        "dtypes": sorted(dtypes),
        "library": list(called),
    }


def _tensors_of(value, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set)):
        return [t for item in value for t in _tensors_of(item, depth + 1)]
    return []


def collect_owners(assign_owners, init_owned, owner_step) -> dict:

    cases = {}
    with library_calls(LIBRARY) as called:
        for what, sizes, P in CASES:
            sizes = lab_numels() if sizes is None else sizes
            try:
                cases[f"{what}/{P}"] = _as_owners(assign_owners(list(sizes), P), len(sizes), P)
            except Exception as exc:  # an answer that breaks on a case: that case fails, the others are judged
                cases[f"{what}/{P}"] = f"raised {type(exc).__name__}: {str(exc)[:80]}"
    ranks = parlab.launch(train_owners, N, assign_owners, init_owned, owner_step, BATCHES, LIBRARY, **LAUNCH)
    return {"cases": cases, "ranks": list(ranks), "library": list(called)}


def single_device_lamb(batches) -> dict[str, torch.Tensor]:
    """The reference: one device, the whole batch, LAMB on every tensor."""
    model = build_lab_model(CFG, seed=0)
    params = list(model.parameters())
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step, (x, y) in enumerate(batches, start=1):
        model.zero_grad(set_to_none=True)
        lab_loss(model(x), y).backward()
        with torch.no_grad():
            for p, m_p, v_p in zip(params, m, v, strict=True):
                lamb_step(p, p.grad, m_p, v_p, step, LR)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def judge_owners(data) -> list[str]:

    ranks = data["ranks"]
    numels = lab_numels()
    called = data["library"] + [c for res in ranks for c in res["library"]]
    lines = [library_verdict("owners", called)]
    for what, sizes, P in [("the lab model", numels, N), *CASES]:
        sizes = numels if sizes is None else sizes
        got = ranks[0]["owners"] if (what, P) == ("the lab model", N) else data["cases"][f"{what}/{P}"]
        lines.append(_assignment_line(what, sizes, P, _as_owners(got, len(sizes), P) if isinstance(got, list) else got))
    owners = ranks[0]["owners"]
    lines.append(
        _line_same("every rank got the same owners from assign_owners", [res["owners"] == owners for res in ranks[1:]])
    )
    with one_thread():
        params = single_device_lamb(BATCHES)
    lines += [
        _dtype_line(ranks),
        tensors_line(
            f"every rank's parameters after {STEPS} LAMB steps", [res["params"] for res in ranks], [params] * N
        ),
        _held_line(ranks, numels),
        _traffic_line(ranks, numels),
    ]
    return lines


def _line_same(what: str, same: list[bool]) -> str:
    if all(same):
        return f"{what}: PASS"
    return f"{what}: rank {1 + same.index(False)} got others: FAIL"


def _assignment_line(what: str, sizes: list[int], P: int, owners) -> str:
    best = best_busiest(sizes, P)
    said = f"tensors {what} over N = {P}: each owned by one rank, the busiest owning as few elements as possible"
    if isinstance(owners, str):
        return f"{said}: {owners}: FAIL"
    mine = busiest(sizes, owners, P)
    if mine == best:
        return f"{said} ({best:,}): PASS"
    return f"{said}: the busiest rank owns {mine:,}, the best assignment's busiest {best:,}: FAIL"


def _owned(numels: list[int], owners: list[int], q: int) -> int:
    return sum(n for n, o in zip(numels, owners, strict=True) if o == q)


def _held_line(ranks: list[dict], numels: list[int]) -> str:
    what = "optimizer state each rank holds: Adam's m and v of the tensors it owns only (2 x 8 bytes an element)"
    for r, res in enumerate(ranks):
        want = 16 * _owned(numels, res["owners"], r) if len(res["owners"]) == len(numels) else None
        if res["held"] != want:
            return f"{what}: rank {r} holds {res['held']:,} bytes, expected {want}: FAIL"
    return f"{what}: PASS"


def _traffic_line(ranks: list[dict], numels: list[int]) -> str:
    """Per rank and step: only reduces to owners and broadcasts from them, each owner's bytes exactly its tensors'."""
    what = (
        "collectives of every rank's steps: reduces to owners and broadcasts from them, each the bytes the owner owns"
    )
    for r, res in enumerate(ranks):
        owners = res["owners"]
        for step, calls in enumerate(res["calls"], start=1):
            others = sorted({c[0] for c in calls} - {"reduce", "broadcast"})
            if others:
                return f"{what}: rank {r}, step {step} called {others}: FAIL"
            for op in ("reduce", "broadcast"):
                for q in range(N):
                    want = 8 * _owned(numels, owners, q)
                    got = sum(c[1] for c in calls if c[0] == op and c[2] == q)
                    if got != want:
                        verb = "to" if op == "reduce" else "from"
                        return (
                            f"{what}: rank {r}, step {step}: {op}s {verb} rank {q}: expected {want:,} bytes (the "
                            f"tensors it owns), received {got:,}: FAIL"
                        )
    return f"{what}: PASS"
