"""Lab 09's checks: the dispatch of expert parallelism (counts, permutation, all_to_all_single with split sizes),
an MoE layer that sends each token at most once to each rank, a prediction of lesson 09's layer's traffic, and a
capacity per expert over the whole group, on live ranks (see parlab/grading).

Every check runs on P = 4 ranks, E = 8 experts placed round-robin (expert e on rank e % P: rank r holds experts r
and r + 4, not the lesson's contiguous blocks), H = 6, float64. The experts are the lab model's MLP
(parlab/core/lab_model.py's SwiGLU, no biases: down(silu(gate x) * up x), width F = 8), not the lesson's. The inputs
are seeded and skewed: some experts get no rows, one rank sends none to some ranks, and a token's two experts often
live on the same rank (experts e and e + 4). What the ranks handed to torch.distributed is recorded at the process
group (parlab.core.probe), and what went through parlab.core.comm from its trace; calls into the library's own
expert-parallel code, and into the checks' reference (parlab/grading/labs/lab09_reference.py: the inputs of every
rank, one device's results), are seen too (`LIBRARY`, parlab/grading/labs/guard.py). The judge recomputes every
reference on one device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.grading.labs import lab09_reference, prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab09_reference import (
    CAPACITY,
    PER,
    ROWS,
    TOKENS,
    TRAFFIC_COUNTS,
    E,
    H,
    K,
    P,
    dispatch_inputs,
    expert_weights,
    experts_of,
    layer_inputs,
    layer_reference,
    owner,
    pair_matrix,
    shuffle_reference,
    traffic_theory,
    upstream,
)

LAUNCH = {"timeout": 30, "echo": False}  # a hang (an all-to-all some rank never makes) is diagnosed after 30 s
A2A = ("all_to_all_single", "alltoall_base", "alltoall")  # the process group's all-to-alls (single tensor, list)
# What the parts must not call: the library's expert parallelism, its MoE layer (the dispatch and combine of one
# device), the hybrid's experts and the lesson's helpers.
LIBRARY = (
    "grading/labs/lab09_reference.py",
    "schemes/expert_parallel.py",
    "core/moe.py",
    "schemes/hybrid/experts.py",
    "lessons/expert_parallel.py",
)
WHAT = "parlab's expert-parallel and MoE code or the checks' reference"
THEORY = lab09_reference.THEORY  # the prediction's theory, one home (tests/test_lab_design.py reads it here)

STRUCTURAL = {
    "dispatch": "round-robin placement, uneven rows (a rank with none, an expert with none): each rank's received "
    "rows, their counts per source and expert, and the gradient of x equal one device's shuffle; the split sizes "
    "each rank handed to the rows' all-to-all (to and from every rank) are the placement's; forward exactly two "
    "all-to-alls (the counts, then the rows), backward one (the rows back); every call through parlab.core.comm; no "
    "call into the library's expert-parallel or MoE code; a FAIL names the first rank and row (which source row "
    "was expected there, which came) or count",
    "combine": "an MoE layer, top-2, round-robin placement, SwiGLU experts: the output, the gradients of x, of the "
    "gates and of every expert's gate, up and down weights (each held by one rank only) equal one device; only "
    "all-to-alls; every float64 all-to-all has the split sizes of one row per (token, destination rank), so a token "
    "whose two experts share a rank travels there once, and the float64 payload is those rows' (H numbers and the "
    "destination's E/P gates out, H back) and nothing more; no call into the library's code",
    "traffic": "a skewed routing given as a table, round-robin placement: the payload rank 0 hands to its "
    "all-to-alls in one forward and backward of lesson 09's layer, and the float64 bytes that leave rank 0 in the "
    "forward, measured from the split sizes of a live run, against the theory and the predictions",
    "capacity": f"a capacity of {CAPACITY} slots per expert over the whole group (rank order, then row order): the "
    "kept assignments of every rank, the output and all gradients equal one device's; the rows' all-to-alls carry "
    "one row per (token, destination) of the kept assignments only, and no float64 data goes through any other "
    "collective; no call into the library's code",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def first_difference(what: str, items: list[tuple[str, object, object]]) -> str:
    """One verdict over many (label, expected, received): PASS when every one is as expected, else FAIL with the
    first that is not, what was expected and what came."""
    wrong = [(label, e, r) for label, e, r in items if e != r]
    if not wrong:
        return f"{what}: all {len(items)} as expected: PASS"
    label, e, r = wrong[0]
    return f"{what}: {len(wrong)} of {len(items)} differ; first {label}: expected {e}, received {r}: FAIL"


def tensors_line(what: str, items: list[tuple[str, object, torch.Tensor]], tol: float = 1e-10) -> str:
    """One verdict over many tensors (label, received, expected): compare's line when all match, else the first
    that does not, with its expected and received size."""
    worst, wrong = 0.0, []
    for label, got, expected in items:
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
            shape = "none" if not isinstance(got, torch.Tensor) else f"shape {list(got.shape)}"
            wrong.append(f"{label}: expected shape {list(expected.shape)}, received {shape}")
            continue
        err = (got.detach().cpu().to(torch.float64) - expected).abs().max().item() if expected.numel() else 0.0
        if not err <= tol:
            wrong.append(
                f"{label}: max |err| {err:.1e}, expected norm {expected.norm():.3e}, received {got.norm():.3e}"
            )
        else:
            worst = max(worst, err)
    if not wrong:
        return f"{what}: matches single device: max |err| {worst:.1e} <= tol {tol:.0e} (float64): PASS"
    return f"{what}: DIFFERS from single device: {len(wrong)} of {len(items)}; first {wrong[0]}: FAIL"


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(parlab.device()) for t in tensors]


# ------------------------------------------------------------------------------------------------ rank code


def _a2a_inputs(calls_before: int) -> list[list]:
    """This rank's all_to_all calls through parlab.core.comm since `calls_before`: [bytes handed over, label]."""
    return [[e.bytes, e.label] for e in comm.trace_events()[calls_before:] if e.kind == "all_to_all"]


def _float_payload_recorder():
    """A context that records, for every process-group call, [op, dtype of its first tensor, bytes of every tensor
    it is handed but the output (all_to_all_single: the input, args[1]), its output and input split sizes (all-to-
    alls; [] when none)]."""
    from torch._C._distributed_c10d import ProcessGroup

    calls: list[list] = []
    names = [n for n in probe._methods(ProcessGroup) if not isinstance(getattr(ProcessGroup, n), type)]

    def wrap(name, original):
        def recorded(self, *args, **kwargs):
            tensors = probe._tensors(args[1] if name in ("all_to_all_single", "alltoall_base") else args[:1])
            dtype = str(tensors[0].dtype) if tensors else ""
            splits = [[], []]
            if name in ("all_to_all_single", "alltoall_base") and len(args) > 3:
                splits = [[int(n) for n in args[2]], [int(n) for n in args[3]]]
            calls.append([name, dtype, sum(t.numel() * t.element_size() for t in tensors), *splits])
            return original(self, *args, **kwargs)

        return recorded

    return probe.wrapped(ProcessGroup, {n: getattr(ProcessGroup, n) for n in names}, wrap), calls


def dispatch_rank(dispatch) -> dict:
    rank = dist.get_rank()
    x, chosen = _on_device(*dispatch_inputs(rank))
    x.requires_grad_()
    start = len(comm.trace_events())
    context, calls = _float_payload_recorder()
    with context:
        with library_calls(LIBRARY) as called:
            received, recv_counts, order = dispatch(x, chosen, E)
        weight = upstream(rank, received.shape[0]).to(received.device)  # the check's, outside the guard
        with library_calls(LIBRARY) as called_back:
            (received * weight).sum().backward()
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return {
        "received": received.detach().clone(),
        "recv_counts": torch.as_tensor(recv_counts).clone(),
        "order": torch.as_tensor(order).clone(),
        "grad": grad.clone(),
        "calls": calls,
        "comm": _a2a_inputs(start),
        "library": list(called) + list(called_back),
    }


def layer_rank(combine, keep_within=None) -> dict:
    """Rank code: an MoE layer made of the student's combine (one assignment per kept (token, choice)), forward and
    backward; with keep_within, only the assignments it keeps (a capacity of CAPACITY per expert over the group)."""
    rank = dist.get_rank()
    x, chosen, gates = _on_device(*layer_inputs(rank))
    x.requires_grad_()
    gates.requires_grad_()
    W = expert_weights()
    weights = {  # keys: global expert ids
        e: {name: W[name][e].clone().to(parlab.device()).requires_grad_() for name in W} for e in experts_of(rank)
    }
    token = torch.arange(TOKENS, device=x.device).repeat_interleave(K)  # [N K]: one per (token, choice), token-major
    flat, gate = chosen.reshape(-1), gates.reshape(-1)
    start = len(comm.trace_events())
    context, calls = _float_payload_recorder()
    with context:
        with library_calls(LIBRARY) as called:
            keep = torch.ones_like(flat, dtype=torch.bool)
            if keep_within is not None:
                keep = torch.as_tensor(keep_within(flat, E, CAPACITY)).bool()
            y = combine(x, token[keep], flat[keep], gate[keep], weights, E)
        weight = upstream(rank, y.shape[0]).to(y.device)  # the check's, outside the guard
        with library_calls(LIBRARY) as called_back:
            (y * weight).sum().backward()

    def grad(t):
        return (t.grad if t.grad is not None else torch.zeros_like(t)).detach().clone()

    return {
        "y": y.detach().clone(),
        "dx": grad(x),
        "dgates": grad(gates),
        "dW": {str(e): {name: grad(w) for name, w in ws.items()} for e, ws in weights.items()},
        "keep": keep.clone(),
        "calls": calls,
        "comm": _a2a_inputs(start),
        "library": list(called) + list(called_back),
    }


def _row_splits(calls: list[list]) -> list[list[list[int]]]:
    """The [output, input] split sizes of a rank's float64 all-to-alls, in the order it made them."""
    return [[out, inp] for op, dtype, _, out, inp in calls if op in A2A and dtype == "torch.float64"]


# ------------------------------------------------------------------------------------------------ the checks


def collect_dispatch(dispatch) -> dict:
    return {"ranks": list(parlab.launch(dispatch_rank, P, dispatch, **LAUNCH))}


def _counts(t: torch.Tensor) -> list:
    """Received counts as [P, E/P] when they have that many, else as they came."""
    t = t.reshape(-1).cpu()
    return t.reshape(P, PER).tolist() if t.numel() == P * PER else t.tolist()


def _which_row(row: torch.Tensor, names: dict[tuple, str]) -> str:
    return names.get(tuple(row.tolist()), "a row of no rank")


def judge_dispatch(data) -> list[str]:
    ranks, ref = data["ranks"], shuffle_reference()
    inputs = [dispatch_inputs(r) for r in range(P)]
    every_row = {
        tuple(x[i].tolist()): f"rank {s}'s row {i} (expert {int(e[i])})"
        for s, (x, e) in enumerate(inputs)
        for i in range(len(x))
    }
    items = []
    for d, (res, exp) in enumerate(zip(ranks, ref, strict=True)):
        got = res["received"].cpu()
        if tuple(got.shape) != tuple(exp["rows"].shape):
            items.append((f"rank {d}", f"{len(exp['names'])} rows", f"shape {list(got.shape)}"))
            continue
        items += [
            (f"rank {d}, received row {i}", name, _which_row(got[i], every_row)) for i, name in enumerate(exp["names"])
        ]
    lines = [first_difference("received rows, every rank, in order (by source, then my expert, then row)", items)]
    counts = [
        (f"rank {d}", exp["counts"].tolist(), _counts(res["recv_counts"]))
        for d, (res, exp) in enumerate(zip(ranks, ref, strict=True))
    ]
    lines.append(first_difference("received counts [P, E/P] (row s: rank s's rows for my experts), every rank", counts))
    grads = []
    for s in range(P):  # dL/dx of row i of rank s: the upstream weight of the row where it landed
        g = torch.zeros(ROWS[s], H, dtype=torch.float64)  # host: the reference on one device
        for i in range(ROWS[s]):
            d = owner(int(inputs[s][1][i]))
            g[i] = upstream(d, ref[d]["rows"].shape[0])[ref[d]["land"][(s, i)]]
        grads.append((f"rank {s}", ranks[s]["grad"], g))
    lines.append(tensors_line("gradient of x (backward), every rank", grads))
    ops = [
        (f"rank {r}", "3 all-to-alls", f"{len(res['calls'])}: {[c[0] for c in res['calls']][:6]}")
        for r, res in enumerate(ranks)
        if len(res["calls"]) != 3 or any(c[0] not in A2A for c in res["calls"])
    ]
    what = "calls per rank: 3 all-to-alls (counts, rows; rows back) and nothing else"
    lines.append(first_difference(what, ops) if ops else f"{what}: PASS")
    M = [[sum(int(owner(int(e)) == d) for e in inputs[s][1]) for d in range(P)] for s in range(P)]
    splits = []
    for r, res in enumerate(ranks):
        receive, send = [M[s][r] for s in range(P)], M[r]
        splits.append((f"rank {r}", [[receive, send], [send, receive]], _row_splits(res["calls"])))
    what = "the rows' split sizes [output, input] of each rank, forward then backward: the round-robin placement's"
    lines.append(first_difference(what, splits))
    payloads = [
        (f"rank {r}", [E * 8, ROWS[r] * H * 8, ref[r]["rows"].shape[0] * H * 8], [b for b, _ in res["comm"]])
        for r, res in enumerate(ranks)
    ]
    lines.append(
        first_difference("all-to-all payloads through parlab.core.comm [counts, rows sent, rows back]", payloads)
    )
    lines.append(library_line("dispatch", [n for res in ranks for n in res["library"]], WHAT))
    return lines


def collect_combine(combine) -> dict:
    return {"ranks": list(parlab.launch(layer_rank, P, combine, **LAUNCH))}


def _layer_lines(ranks: list[dict], ref: list[dict], what: str) -> list[str]:
    y = [(f"rank {r}", res["y"], exp["y"]) for r, (res, exp) in enumerate(zip(ranks, ref, strict=True))]
    dx = [
        (f"rank {r}, {name}", res[key], exp[key])
        for r, (res, exp) in enumerate(zip(ranks, ref, strict=True))
        for key, name in (("dx", "dL/dx"), ("dgates", "dL/dgates"))
    ]
    dW = [
        (f"rank {r}, expert {e} {name}", res["dW"].get(e, {}).get(name), w)
        for r, (res, exp) in enumerate(zip(ranks, ref, strict=True))
        for e, ws in exp["dW"].items()
        for name, w in ws.items()
    ]
    return [
        tensors_line(f"{what}: output y, every rank", y),
        tensors_line(f"{what}: gradients of x and of the gates, every rank", dx),
        tensors_line(f"{what}: gradients of every expert's gate, up and down weights", dW),
    ]


def _float_payloads(rank: dict) -> tuple[int, int]:
    """(float64 bytes handed to all-to-alls, float64 bytes handed to any other call) by one rank."""
    floats = [(call[0], call[2]) for call in rank["calls"] if call[1] == "torch.float64"]
    a2a = sum(b for op, b in floats if op in A2A)
    return a2a, sum(b for _, b in floats) - a2a


def _traffic_lines(ranks: list[dict], ref: list[dict], what: str) -> list[str]:
    """Every float64 all-to-all carries one row per (token, destination) pair, and the payload is those rows'."""
    M, items, payload = pair_matrix(ref), [], []
    for r, res in enumerate(ranks):
        receive, send = [M[s][r] for s in range(P)], M[r]
        allowed = [
            [receive, send],
            [send, receive],
        ]  # the dispatch and the combine's backward; the combine and the dispatch's
        got = _row_splits(res["calls"])
        ok = all(split in allowed for split in got) and all(way in got for way in allowed)
        expected = f"{allowed[0]} and {allowed[1]} only"
        items.append((f"rank {r}", expected, expected if ok else f"{got}"))
        rows = sum(send) + sum(receive)  # each row out and back, forward and backward: 2 H numbers at least
        least, most = rows * 2 * H * 8, rows * (2 * H + PER) * 8  # at most E/P more on the way out (and its grad)
        expected, got = f"between {least:,} and {most:,} bytes", _float_payloads(res)[0]
        payload.append((f"rank {r}", expected, expected if least <= got <= most else f"{got:,} bytes"))
    return [
        first_difference(
            f"{what}: split sizes [output, input] of every float64 all-to-all: one row per (token, destination rank)",
            items,
        ),
        first_difference(
            f"{what}: float64 payload of the all-to-alls: each pair's row out (H and at most E/P) and back (H)", payload
        ),
    ]


def _only_all_to_alls(ranks: list[dict], what: str) -> str:
    ops = [
        (f"rank {r}", "all-to-alls only", [c[0] for c in res["calls"] if c[0] not in A2A][:3])
        for r, res in enumerate(ranks)
    ]
    ops = [item for item in ops if item[2]]
    return first_difference(what, ops) if ops else f"{what}: PASS"


def judge_combine(data) -> list[str]:
    ranks, ref = data["ranks"], layer_reference()
    lines = _layer_lines(ranks, ref, "MoE layer")
    lines.append(_only_all_to_alls(ranks, "MoE layer: calls into torch.distributed, every rank: all-to-alls only"))
    lines += _traffic_lines(ranks, ref, "MoE layer")
    lines.append(library_line("combine", [n for res in ranks for n in res["library"]], WHAT))
    return lines


def traffic_rank() -> dict:
    """Rank code: parlab's expert-parallel layer (lesson 09) on the routing of TRAFFIC_COUNTS, forward and backward,
    its experts renumbered so that its rank r holds the round-robin experts of rank r. Returns the payload this
    rank handed to its all-to-alls (parlab.core.comm's trace) and the float64 bytes that left it in the forward (the
    split sizes it handed over, less the rows it sent itself)."""
    from parlab.core.moe import MoE, MoEConfig, Routing
    from parlab.schemes.expert_parallel import ExpertParallelMoE

    rank = dist.get_rank()
    layout = sorted(range(E), key=lambda e: (owner(e), e))  # the library's expert i is round-robin expert layout[i]
    renumber = torch.tensor([layout.index(e) for e in range(E)])  # host: ids, then moved with the rows
    counts = torch.tensor(TRAFFIC_COUNTS[rank])  # host: the table
    expert = torch.arange(E).repeat_interleave(counts).to(parlab.device())  # host: the table, then moved; [n]
    n = expert.numel()
    gen = torch.Generator().manual_seed(400 + rank)
    x = torch.randn(n, H, generator=gen, dtype=torch.float64).to(parlab.device())  # host: the seeded draw
    x.requires_grad_()  # so that backward runs the dispatch's reverse shuffle too
    layer = ExpertParallelMoE(MoE(H, H, MoEConfig(experts=E, top_k=1)).double().to(parlab.device()), group=None)
    ones = torch.ones(n, 1, dtype=torch.float64, device=x.device)
    routing = Routing(
        renumber.to(x.device)[expert].unsqueeze(1),
        ones,
        ones.bool(),
        torch.zeros((), device=x.device),
        torch.bincount(expert),
    )
    start = len(comm.trace_events())
    context, calls = _float_payload_recorder()
    with context:
        y = layer.run_experts(x, routing)
    y.sum().backward()
    wire = sum((sum(inp) - inp[rank]) * H * 8 for op, dtype, _, _, inp in calls if dtype == "torch.float64")
    return {"payload": sum(b for b, _ in _a2a_inputs(start)), "wire": wire}


def collect_traffic(payload_rank0, wire_rank0) -> dict:
    measured = parlab.launch(traffic_rank, P, **LAUNCH)[0]
    return {"predicted": [payload_rank0, wire_rank0], "measured": [measured["payload"], measured["wire"]]}


def judge_traffic(data) -> list[str]:
    theory = traffic_theory()
    (p_pay, p_wire), (m_pay, m_wire) = data["predicted"], data["measured"]
    return prediction_lines(
        "payload rank 0 hands to all-to-alls, forward and backward", p_pay, theory["payload_rank0"], m_pay, rtol=0.005
    ) + prediction_lines("float64 bytes leaving rank 0, forward", p_wire, theory["wire_rank0"], m_wire, rtol=0.005)


def collect_capacity(keep_within_capacity, combine) -> dict:
    return {"ranks": list(parlab.launch(layer_rank, P, combine, keep_within_capacity, **LAUNCH))}


def _kept(mask: torch.Tensor) -> list[int]:
    return mask.reshape(-1).nonzero().flatten().tolist()


def judge_capacity(data) -> list[str]:
    ranks, ref = data["ranks"], layer_reference(capacity=CAPACITY)
    load = torch.bincount(torch.cat([x["chosen"].flatten() for x in ref]), minlength=E)
    dropped = int((load - CAPACITY).clamp(min=0).sum())
    empty = int((CAPACITY - load).clamp(min=0).sum())
    lines = [
        f"capacity {CAPACITY} per expert over the group: {P * TOKENS * K} assignments (P x N x k) for "
        f"{E * CAPACITY} slots (E x C); load per expert {load.tolist()}: the busy experts drop {dropped}, "
        f"the others leave {empty} slots empty"
    ]
    kept = [
        (f"rank {r}", f"assignments {_kept(x['keep'])}", f"assignments {_kept(res['keep'].reshape(TOKENS, K))}")
        for r, (res, x) in enumerate(zip(ranks, ref, strict=True))
    ]
    lines.append(first_difference("kept assignments of every rank (index token x k + choice)", kept))
    lines += _layer_lines(ranks, ref, f"capacity {CAPACITY}")
    lines += _traffic_lines(ranks, ref, f"capacity {CAPACITY}")
    other = [(f"rank {r}", "0 bytes", f"{_float_payloads(res)[1]:,} bytes") for r, res in enumerate(ranks)]
    lines.append(first_difference("float64 data handed to collectives other than all-to-alls", other))
    lines.append(library_line("capacity", [n for res in ranks for n in res["library"]], WHAT))
    return lines
