"""Lab 09's checks: the dispatch of expert parallelism without an all-to-all (P - 1 rounds of pairwise exchanges:
counts, then rows; backward the other way), an MoE layer that sends each token at most once to each rank, a
prediction of that layer's rows on the wire for two placements, and a capacity per expert over the whole group
learnt from the least traffic, on live ranks (see parlab/grading).

Every check runs on P = 4 ranks, E = 8 experts placed round-robin (expert e on rank e % P: rank r holds experts r
and r + 4, not the lesson's contiguous blocks), H = 6, float64. The experts are the lab model's MLP
(parlab/core/lab_model.py's SwiGLU, no biases: down(silu(gate x) * up x), width F = 8), not the lesson's. The inputs
are seeded and skewed: some experts get no rows, one rank sends none to some ranks, and a token's two experts often
live on the same rank (experts e and e + 4). Every call the ranks make into torch.distributed is recorded at the
process group (its op, dtype, shape and peer), and what went through parlab.core.comm from its trace; calls into the
library's own expert-parallel code, and into the checks' reference (parlab/grading/labs/lab09_reference.py: the
inputs of every rank, one device's results), are seen too (`LIBRARY`, parlab/grading/labs/guard.py). The judge
recomputes every reference on one device. A real deadlock (gloo's blocking send waits for its receive) is diagnosed
by parlab.launch within the launch timeout.
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
    traffic_inputs,
    traffic_theory,
    upstream,
)

LAUNCH = {"timeout": 15, "echo": False}  # a hang no deadlock diagnosis names is stopped after 15 s
P2P = ("send", "recv", "recv_anysource")  # the process group's point-to-point calls (isend and irecv too)
# What the parts must not call: the library's expert parallelism, its MoE layer (the dispatch and combine of one
# device), the hybrid's experts, the lesson's helpers and the checks' reference.
LIBRARY = (
    "grading/labs/lab09_reference.py",
    "schemes/expert_parallel.py",
    "core/moe.py",
    "schemes/hybrid/experts.py",
    "lessons/expert_parallel.py",
)
WHAT = "parlab's expert-parallel and MoE code or the checks' reference"
TRAFFIC_PAIRS = lab09_reference.TRAFFIC_PAIRS  # the prediction's table, read in the handout
THEORY = lab09_reference.THEORY  # the prediction's theory, one home (tests/test_lab_design.py reads it here)

STRUCTURAL = {
    "dispatch": "round-robin placement, uneven rows (a rank with none, a rank that sends to only two, experts with "
    "none): each rank's received rows (stacked by source rank, whatever round they came in), their counts per "
    "source and expert, and the gradient of x equal one device's shuffle; only point-to-point messages, each through "
    "parlab.core.comm, none to itself, no collective; each rank sends every other rank one int64 message of that "
    "rank's E/P counts and, only when it has rows for it, one float64 message of exactly those rows, and in the "
    "backward one float64 message of the gradients of the rows it received from each source; the counts go in P - 1 "
    "rounds, each a permutation (every rank sends to one and receives from the one that sends to it, checked across "
    "the ranks), the rows in the counts' rounds, the backward in the forward's rounds (in order or reversed); no "
    "call into the library's expert-parallel or MoE code; a FAIL names the first rank, row, message or round with "
    "expected and received",
    "combine": "an MoE layer, top-2, round-robin placement, SwiGLU experts: the output, the gradients of x, of the "
    "gates and of every expert's gate, up and down weights (each held by one rank only) equal one device; only "
    "point-to-point messages (no collective); the float64 messages between every two ranks carry one row per "
    "(token, destination rank) each way, forward and backward (a token whose two experts share a rank travels there "
    "once), each row at least H and at most H + E/P numbers; no call into the library's code",
    "traffic": "a routing given as a table of the tokens' expert pairs: the float64 rows that leave rank 0 in one "
    "forward of the part-2 layer, round-robin and contiguous placements, exactly; once right, the rows measured from "
    "the shapes of the messages the answer's own layer sent on that routing are shown beside it (not scored)",
    "capacity": f"a capacity of {CAPACITY} slots per expert over the whole group (rank order, then row order): the "
    "kept assignments of every rank, the output and all gradients equal one device's; the mask made from point-to-"
    "point int64 messages only, each rank receiving at most E numbers and sending at most E (what the lower ranks "
    "took, not every rank's counts); the layer's float64 messages carry one row per (token, destination) of the "
    "kept assignments only; no collective; no call into the library's code",
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


def _recorder():
    """A context that records, for every process-group call, [op, dtype of its data, its shape, peer]: the data of
    a send or receive is its tensor and the peer its rank in the group; for an all-to-all the input; for any other
    call the first tensor it is handed (peer -1)."""
    from torch._C._distributed_c10d import ProcessGroup

    calls: list[list] = []
    names = [n for n in probe._methods(ProcessGroup) if not isinstance(getattr(ProcessGroup, n), type)]

    def wrap(name, original):
        def recorded(self, *args, **kwargs):
            tensors = probe._tensors(args[1] if name in ("all_to_all_single", "alltoall_base") else args[:1])
            peer = int(args[1]) if name in ("send", "recv") and len(args) > 1 else -1
            first = tensors[0] if tensors else torch.zeros(0)  # host: a stand-in for a call without data
            calls.append([name, str(first.dtype).removeprefix("torch."), list(first.shape), peer])
            return original(self, *args, **kwargs)

        return recorded

    return probe.wrapped(ProcessGroup, {n: getattr(ProcessGroup, n) for n in names}, wrap), calls


def _traced_p2p(calls_before: int) -> int:
    """This rank's sends and receives through parlab.core.comm since `calls_before`."""
    return sum(1 for e in comm.trace_events()[calls_before:] if e.kind in ("send", "recv"))


def dispatch_rank(dispatch) -> dict:
    rank = dist.get_rank()
    x, chosen = _on_device(*dispatch_inputs(rank))
    x.requires_grad_()
    start = len(comm.trace_events())
    context, calls = _recorder()
    with context:
        with library_calls(LIBRARY) as called:
            received, recv_counts, order = dispatch(x, chosen, E)
        forward = len(calls)
        weight = upstream(rank, received.shape[0]).to(received.device)  # the check's, outside the guard
        with library_calls(LIBRARY) as called_back:
            (received * weight).sum().backward()
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return {
        "received": received.detach().clone(),
        "recv_counts": torch.as_tensor(recv_counts).clone(),
        "order": torch.as_tensor(order).clone(),
        "grad": grad.clone(),
        "forward": calls[:forward],
        "backward": calls[forward:],
        "traced": _traced_p2p(start),
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
    context, calls = _recorder()
    with context:
        with library_calls(LIBRARY) as called:
            keep = torch.ones_like(flat, dtype=torch.bool)
            if keep_within is not None:
                keep = torch.as_tensor(keep_within(flat, E, CAPACITY)).bool()
            keeping = len(calls)
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
        "keep_calls": calls[:keeping],
        "calls": calls[keeping:],
        "library": list(called) + list(called_back),
    }


# ------------------------------------------------------------------------------------------------ messages


def _messages(calls: list[list], op: str, dtype: str | None = None) -> list[list]:
    """The sends (op "send") or receives (op "recv") among a rank's calls, in the order it made them:
    [dtype, shape, peer]."""
    return [[d, shape, peer] for name, d, shape, peer in calls if name == op and (dtype is None or d == dtype)]


def _shown(messages: list[list]) -> str:
    """Messages to or from one peer as text: 'int64 x2 + float64 [3, 6]', or 'nothing'."""
    parts = []
    for dtype, shape, _ in messages:
        parts.append(f"{dtype} x{_numel(shape)}" if dtype == "int64" else f"{dtype} {shape}")
    return " + ".join(parts) or "nothing"


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _not_p2p(ranks: list[dict], key: str) -> list[tuple[str, object, object]]:
    """(rank, expected, received) for every rank that made a call other than a send or a receive."""
    items = []
    for r, res in enumerate(ranks):
        others = [c[0] for c in res[key] if c[0] not in P2P]
        items.append(
            (f"rank {r}", "sends and receives only", f"also {others[:3]}" if others else "sends and receives only")
        )
    return items


def _rounds_line(ranks: list[dict]) -> tuple[str, list[list[int]]]:
    """The verdict on the counts' rounds (a rank's k-th int64 send and receive are its round k) and, per rank, the
    peers it sends its counts to, in order."""
    sends = [[peer for _, _, peer in _messages(res["forward"], "send", "int64")] for res in ranks]
    recvs = [[peer for _, _, peer in _messages(res["forward"], "recv", "int64")] for res in ranks]
    what = "the counts' P - 1 rounds: in each, every rank sends to one rank and receives from the one sending to it"
    for r in range(P):
        if len(sends[r]) != P - 1 or len(recvs[r]) != P - 1:
            return (
                f"{what}: rank {r} sends {len(sends[r])} and receives {len(recvs[r])} counts, expected {P - 1}: FAIL",
                sends,
            )
    for k in range(P - 1):
        to = [sends[r][k] for r in range(P)]
        for d in range(P):
            senders = [r for r in range(P) if to[r] == d]
            if len(senders) > 1:
                return f"{what}: round {k + 1}: ranks {senders} all send to rank {d}: FAIL", sends
        for r in range(P):
            if recvs[to[r]][k] != r:
                return (
                    f"{what}: round {k + 1}: rank {r} sends to rank {to[r]}, which receives from rank "
                    f"{recvs[to[r]][k]} in that round: FAIL",
                    sends,
                )
    return f"{what}: PASS", sends


def _order_items(ranks: list[dict], M: list[list[int]], count_peers: list[list[int]]) -> list[tuple]:
    """Per rank: the rows go in the counts' rounds (the same partners, in the same order, leaving out the pairs
    without rows), and the backward in the forward's rounds, in order or reversed."""
    items = []
    for r, res in enumerate(ranks):
        recv_peers = [peer for _, _, peer in _messages(res["forward"], "recv", "int64")]
        send_rows = [d for d in count_peers[r] if M[r][d] > 0]
        recv_rows = [s for s in recv_peers if M[s][r] > 0]
        got_send = [peer for _, _, peer in _messages(res["forward"], "send", "float64")]
        got_recv = [peer for _, _, peer in _messages(res["forward"], "recv", "float64")]
        items.append(
            (f"rank {r}, forward", f"rows to {send_rows}, from {recv_rows}", f"rows to {got_send}, from {got_recv}")
        )
        back_send = [peer for _, _, peer in _messages(res["backward"], "send", "float64")]
        back_recv = [peer for _, _, peer in _messages(res["backward"], "recv", "float64")]
        ways = [(got_recv, got_send), (got_recv[::-1], got_send[::-1])]
        expected = f"gradients to {got_recv}, from {got_send} (or both reversed)"
        shown = f"gradients to {back_send}, from {back_recv}"
        items.append((f"rank {r}, backward", expected, expected if (back_send, back_recv) in ways else shown))
    return items


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

    calls = _not_p2p(ranks, "forward") + _not_p2p(ranks, "backward")
    calls = [item for item in calls if item[1] != item[2]]
    for r, res in enumerate(ranks):
        made = len(
            _messages(res["forward"] + res["backward"], "send") + _messages(res["forward"] + res["backward"], "recv")
        )
        to_self = [peer for peer in (m[2] for m in _messages(res["forward"] + res["backward"], "send")) if peer == r]
        if res["traced"] != made:
            calls.append((f"rank {r}", f"{made} messages through parlab.core.comm", f"{res['traced']}"))
        if to_self:
            calls.append((f"rank {r}", "no message to itself", f"{len(to_self)} sent to rank {r}"))
    what = "calls, every rank: sends and receives only (no collective), through parlab.core.comm, none to itself"
    lines.append(first_difference(what, calls) if calls else f"{what}: PASS")

    M = [[sum(int(owner(int(e)) == d) for e in inputs[s][1]) for d in range(P)] for s in range(P)]

    def wanted(rows: int) -> list[list]:
        return [["float64", [rows, H], -1]] if rows else []

    forward, backward = [], []
    for r, res in enumerate(ranks):
        for d in range(P):
            if d == r:
                continue
            sent = [m for m in _messages(res["forward"], "send") if m[2] == d]
            got = [m for m in _messages(res["forward"], "recv") if m[2] == d]
            counts_msg = [["int64", [PER], -1]]
            forward.append((f"rank {r} to rank {d}", _shown(counts_msg + wanted(M[r][d])), _shown(sent)))
            forward.append((f"rank {r} from rank {d}", _shown(counts_msg + wanted(M[d][r])), _shown(got)))
            sent = [m for m in _messages(res["backward"], "send") if m[2] == d]
            got = [m for m in _messages(res["backward"], "recv") if m[2] == d]
            backward.append((f"rank {r} to rank {d}", _shown(wanted(M[d][r])), _shown(sent)))
            backward.append((f"rank {r} from rank {d}", _shown(wanted(M[r][d])), _shown(got)))
    what = "forward messages between every two ranks: the receiver's E/P counts (int64), then its rows if it has any"
    lines.append(first_difference(what, forward))
    what = "backward messages between every two ranks: the gradients of the rows, back to where they came from"
    lines.append(first_difference(what, backward))
    rounds, count_peers = _rounds_line(ranks)
    lines.append(rounds)
    what = "the rows in the counts' rounds (pairs without rows left out), the backward in the forward's rounds"
    lines.append(first_difference(what, _order_items(ranks, M, count_peers)))
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


def _traffic_lines(ranks: list[dict], ref: list[dict], what: str) -> list[str]:
    """Between every two ranks, the float64 messages carry one row per (token, destination) pair each way: r sends
    d its pairs' rows (forward) and the gradients of d's results for them (backward), and d's pairs' results
    (forward) and the gradients of d's rows (backward). Messages without rows are left out here (part 1 checks
    them)."""
    M, items, widths = pair_matrix(ref), [], []
    for r, res in enumerate(ranks):
        sent = [m for m in _messages(res["calls"], "send", "float64") if _numel(m[1])]
        for d in range(P):
            if d == r:
                continue
            expected = sorted([M[r][d]] * 2 * (M[r][d] > 0) + [M[d][r]] * 2 * (M[d][r] > 0))
            got = sorted(shape[0] if len(shape) == 2 else _numel(shape) for _, shape, peer in sent if peer == d)
            items.append((f"rank {r} to rank {d}", f"messages of {expected} rows", f"messages of {got} rows"))
        bad = [shape for _, shape, _ in sent if len(shape) != 2 or not H <= shape[1] <= H + PER]
        widths.append(
            (
                f"rank {r}",
                f"rows of {H} to {H + PER} numbers",
                f"a message of shape {bad[0]}" if bad else f"rows of {H} to {H + PER} numbers",
            )
        )
    return [
        first_difference(
            f"{what}: float64 messages between every two ranks, forward and backward: one row per (token, "
            "destination rank) each way",
            items,
        ),
        first_difference(f"{what}: every float64 message: rows [m, w] of H <= w <= H + E/P numbers", widths),
    ]


def _only_p2p(ranks: list[dict], key: str, what: str) -> str:
    items = [item for item in _not_p2p(ranks, key) if item[1] != item[2]]
    return first_difference(what, items) if items else f"{what}: PASS"


def judge_combine(data) -> list[str]:
    ranks, ref = data["ranks"], layer_reference()
    lines = _layer_lines(ranks, ref, "MoE layer")
    lines.append(
        _only_p2p(ranks, "calls", "MoE layer: calls into torch.distributed, every rank: sends and receives only")
    )
    lines += _traffic_lines(ranks, ref, "MoE layer")
    lines.append(library_line("combine", [n for res in ranks for n in res["library"]], WHAT))
    return lines


def traffic_rank(combine) -> int:
    """Rank code: the answer's own layer, forward only, on the prediction's routing (TRAFFIC_PAIRS); returns the
    rows of the float64 messages this rank sent (the first dimension of each)."""
    rank = dist.get_rank()
    x, chosen, gates = _on_device(*traffic_inputs(rank))
    W = expert_weights()
    weights = {e: {name: W[name][e].to(parlab.device()) for name in W} for e in experts_of(rank)}
    token = torch.arange(len(x), device=x.device).repeat_interleave(K)
    context, calls = _recorder()
    with context, torch.no_grad():
        combine(x, token, chosen.reshape(-1), gates.reshape(-1), weights, E)
    return sum(shape[0] for _, shape, _ in _messages(calls, "send", "float64") if shape)


def collect_traffic(rows_round_robin, rows_contiguous, combine) -> dict:
    try:  # the measurement is shown, not scored: a layer that is not written yet costs the prediction nothing
        measured = parlab.launch(traffic_rank, P, combine, **LAUNCH)[0]
    except Exception as exc:  # noqa: BLE001 (any failure of the answer's layer)
        measured = f"not measured: your layer failed ({type(exc).__name__})"
    return {"predicted": [rows_round_robin, rows_contiguous], "measured": measured}


def judge_traffic(data) -> list[str]:
    theory = traffic_theory()
    (p_rr, p_contiguous), measured = data["predicted"], data["measured"]
    label = "float64 rows leaving rank 0 in one forward of the part-2 layer"
    rr = prediction_lines(f"{label}, round-robin", p_rr, theory["rows_round_robin"], rtol=0)
    lines = rr + prediction_lines(f"{label}, contiguous blocks", p_contiguous, theory["rows_contiguous"], rtol=0)
    if rr[-1].endswith("PASS"):  # shown once the prediction is right, as the theory is
        shown = f"{measured} rows" if isinstance(measured, int) else measured
        lines.append(f"{label}, round-robin, measured from your layer's messages on this routing: {shown}")
    return lines


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
    least = []
    for r, res in enumerate(ranks):
        calls = res["keep_calls"]
        others = [c[0] for c in calls if c[0] not in P2P] + [c[1] for c in calls if c[0] in P2P and c[1] != "int64"]
        sent = sum(_numel(shape) for _, shape, _ in _messages(calls, "send"))
        got = sum(_numel(shape) for _, shape, _ in _messages(calls, "recv"))
        expected = f"int64 messages only, at most {E} numbers in and {E} out"
        shown = f"also {others[:3]}" if others else f"{got} numbers in, {sent} out"
        least.append((f"rank {r}", expected, expected if not others and got <= E and sent <= E else shown))
    what = "the mask: what each rank learns from the others (the least it needs: what the lower ranks took)"
    lines.append(first_difference(what, least))
    lines += _layer_lines(ranks, ref, f"capacity {CAPACITY}")
    lines.append(
        _only_p2p(ranks, "calls", f"capacity {CAPACITY}: calls of the layer, every rank: sends and receives only")
    )
    lines += _traffic_lines(ranks, ref, f"capacity {CAPACITY}")
    lines.append(library_line("capacity", [n for res in ranks for n in res["library"]], WHAT))
    return lines
