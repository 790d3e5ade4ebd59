"""Lab 09's checks: the dispatch of expert parallelism (counts, permutation, all_to_all_single with split sizes),
the combine (an MoE layer forward and backward), a prediction of its traffic, and a capacity per expert over the
whole group, on live ranks (see parlab/grading).

Every check runs on P = 4 ranks, E = 8 experts placed round-robin (expert e on rank e % P: rank r holds experts r
and r + 4, not the lesson's contiguous blocks), H = 6, float64. The inputs are seeded and skewed: some experts get no
rows, one rank sends none to some ranks. What the ranks handed to
torch.distributed is recorded at the process group (parlab.core.probe), and what went through parlab.core.comm from
its trace; the judge recomputes every reference on one device.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.check import check_equal, compare
from parlab.grading.labs import prediction_lines, run_check

LAUNCH = {"timeout": 60, "echo": False}
P, E, H = 4, 8, 6  # ranks, experts, hidden size
PER = E // P  # experts per rank: rank r holds r, r + P, r + 2P, ... (round-robin)
K = 2  # experts per token
TOKENS = 10  # tokens per rank in the combine and capacity checks
ROWS = (5, 0, 7, 9)  # rows per rank in the dispatch check (rank 1 sends nothing)
CAPACITY = 8  # slots per expert over the whole group in the capacity check
# The prediction's routing: TRAFFIC_COUNTS[s][e] = rows (assignments) rank s routes to expert e.
TRAFFIC_COUNTS = [
    [6, 1, 0, 3, 5, 2, 0, 4],
    [2, 7, 1, 0, 4, 0, 3, 1],
    [0, 2, 9, 1, 3, 1, 2, 0],
    [5, 0, 2, 6, 1, 3, 0, 2],
]
A2A = ("all_to_all_single", "alltoall_base", "alltoall")  # the process group's all-to-alls (single tensor, list)

STRUCTURAL = {
    "dispatch": "round-robin placement, uneven rows (a rank with none, an expert with none): each rank's received "
    "rows, their counts per source and expert, and the gradient of x equal one device's shuffle; the split sizes "
    "each rank handed to the rows' all-to-all (to and from every rank) are the placement's; forward exactly two "
    "all-to-alls (the counts, then the rows), backward one (the rows back); every call through parlab.core.comm",
    "combine": "an MoE layer, top-2, round-robin placement: the output, the gradients of x, of the gates and of "
    "every expert's weights (each held by one rank only) equal one device; five all-to-alls (counts, dispatch, "
    "combine; backward: combine, dispatch) and no other collective; the split sizes are the placement's and the "
    "float64 payload is the rows' only",
    "traffic": "a skewed routing given as a table, round-robin placement: the payload rank 0 hands to its "
    "all-to-alls in one forward and backward, and the float64 bytes that leave rank 0 in the forward, measured from "
    "the split sizes of a live run, against the theory and the predictions",
    "capacity": f"a capacity of {CAPACITY} slots per expert over the whole group (rank order, then row order): the "
    "kept assignments of every rank, the output and all gradients equal one device's; the float64 payload of the "
    "all-to-alls is the kept rows only and no float64 data goes through any other collective",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ------------------------------------------------------------------------------------------------ inputs


def expert(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Expert e on its rows: tanh(rows @ W_e). rows [n, H], w [H, H] -> [n, H]."""
    return torch.tanh(rows @ w)


def owner(e: int) -> int:
    """The rank that holds expert e (round-robin)."""
    return e % P


def experts_of(rank: int) -> list[int]:
    """The global ids of the experts `rank` holds, in its local order."""
    return [e for e in range(E) if owner(e) == rank]


def expert_weights() -> torch.Tensor:
    """W [E, H, H]: every expert's weights (rank r holds W[e] for its experts only)."""
    return torch.randn(E, H, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64) / math.sqrt(H)


def dispatch_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows x [n, H] and the expert of each row [n] (skewed: experts 3 and 6 get none)."""
    gen = torch.Generator().manual_seed(100 + rank)
    n = ROWS[rank]
    x = torch.randn(n, H, generator=gen, dtype=torch.float64)
    choices = torch.tensor([0, 1, 2, 4, 5, 7, 7, 0])
    if rank == 3:
        choices = torch.tensor([2, 7, 7, 2])  # rank 3 sends nothing to ranks 0 and 1
    return x, choices[torch.randint(len(choices), (n,), generator=gen)]


def layer_inputs(rank: int, tokens: int = TOKENS):
    """Rank r's tokens x [N, H], their K experts [N, K] (distinct, skewed) and gates [N, K] (rows sum to 1)."""
    gen = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(tokens, H, generator=gen, dtype=torch.float64)
    probs = torch.tensor([8.0, 1, 4, 0.2, 3, 6, 0.5, 2], dtype=torch.float64)
    chosen = torch.stack([torch.multinomial(probs, K, generator=gen) for _ in range(tokens)])
    gates = torch.rand(tokens, K, generator=gen, dtype=torch.float64) + 0.1
    return x, chosen, gates / gates.sum(dim=1, keepdim=True)


def upstream(rank: int, rows: int) -> torch.Tensor:
    """A fixed weight [rows, H] per output row: backward of (out * upstream).sum()."""
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(300 + rank), dtype=torch.float64)


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
    x, chosen = dispatch_inputs(rank)
    x.requires_grad_()
    start = len(comm.trace_events())
    context, calls = _float_payload_recorder()
    with context:
        received, recv_counts, order = dispatch(x, chosen, E)
        (received * upstream(rank, received.shape[0])).sum().backward()
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return {
        "received": received.detach().clone(),
        "recv_counts": torch.as_tensor(recv_counts).clone(),
        "order": torch.as_tensor(order).clone(),
        "grad": grad.clone(),
        "calls": calls,
        "comm": _a2a_inputs(start),
    }


def layer_rank(combine, keep_within=None) -> dict:
    """Rank code: an MoE layer made of the student's combine (one row per kept assignment), forward and backward;
    with keep_within, only the assignments it keeps (a capacity of CAPACITY per expert over the group)."""
    rank = dist.get_rank()
    x, chosen, gates = layer_inputs(rank)
    x.requires_grad_()
    gates.requires_grad_()
    W = expert_weights()
    weights = {e: W[e].clone().requires_grad_() for e in experts_of(rank)}  # keys: global expert ids
    token = torch.arange(TOKENS).repeat_interleave(K)  # [N K]: one row per (token, choice), token-major
    flat, gate = chosen.reshape(-1), gates.reshape(-1)
    start = len(comm.trace_events())
    context, calls = _float_payload_recorder()
    with context:
        keep = torch.ones_like(flat, dtype=torch.bool)
        if keep_within is not None:
            keep = torch.as_tensor(keep_within(flat, E, CAPACITY)).bool()
        y = combine(x, token[keep], flat[keep], gate[keep], weights, E)
        (y * upstream(rank, y.shape[0])).sum().backward()

    def grad(t):
        return (t.grad if t.grad is not None else torch.zeros_like(t)).detach().clone()

    return {
        "y": y.detach().clone(),
        "dx": grad(x),
        "dgates": grad(gates),
        "dW": {str(e): grad(w) for e, w in weights.items()},
        "keep": keep.clone(),
        "calls": calls,
        "comm": _a2a_inputs(start),
    }


# ------------------------------------------------------------------------------------------------ one device


def shuffle_reference() -> list[dict]:
    """Per destination rank d: the rows it receives (by source, then its experts in local order, each expert's rows
    in their order), the counts [P, PER], and where each source row lands (for the gradient of x)."""
    inputs = [dispatch_inputs(r) for r in range(P)]
    out = []
    for d in range(P):
        rows, counts, land = [], torch.zeros(P, PER, dtype=torch.long), {}
        for s, (x, chosen) in enumerate(inputs):
            for j, e in enumerate(experts_of(d)):
                idx = (chosen == e).nonzero().flatten().tolist()
                counts[s, j] = len(idx)
                for i in idx:
                    land[(s, i)] = len(rows)
                    rows.append(x[i])
        out.append(
            {
                "rows": torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.float64),
                "counts": counts,
                "land": land,
            }
        )
    return out


def layer_reference(tokens: int = TOKENS, capacity: int | None = None):
    """One device: every rank's y, the gradients, and the kept mask [N, K] per rank (global slots: rank order, then
    row order of expert.flatten())."""
    W = expert_weights().requires_grad_()
    used, results = [0] * E, []
    for r in range(P):
        x, chosen, gates = layer_inputs(r, tokens)
        x.requires_grad_(), gates.requires_grad_()
        keep = torch.ones_like(chosen, dtype=torch.bool)
        if capacity is not None:
            for flat, e in enumerate(chosen.flatten().tolist()):
                keep.view(-1)[flat] = used[e] < capacity
                used[e] += 1
        y = torch.zeros_like(x)
        for i in range(tokens):
            for j in range(K):
                if keep[i, j]:
                    y = y.index_add(0, torch.tensor([i]), gates[i, j] * expert(W[chosen[i, j]], x[i : i + 1]))
        (y * upstream(r, tokens)).sum().backward()
        results.append({"y": y.detach(), "dx": x.grad, "dgates": gates.grad, "keep": keep, "chosen": chosen})
    for r in range(P):
        results[r]["dW"] = {str(e): W.grad[e] for e in experts_of(r)}
    return results


def split_matrix(ref: list[dict]) -> list[list[int]]:
    """M[s][d]: kept rows rank s sends to rank d (the owner of their expert)."""
    return [[int(((x["chosen"] % P == d) & x["keep"]).sum()) for d in range(P)] for x in ref]


def _row_splits(calls: list[list]) -> list[list[list[int]]]:
    """The [output, input] split sizes of a rank's float64 all-to-alls, sorted (the order between calls aside)."""
    return sorted([out, inp] for op, dtype, _, out, inp in calls if op in A2A and dtype == "torch.float64")


def _expected_splits(M: list[list[int]], rank: int, calls: int) -> list[list[list[int]]]:
    """The sorted [output, input] split sizes of `calls` row all-to-alls of `rank`: half rows out (receive from
    each rank, send to each rank), half rows back (the same, swapped)."""
    receive, send = [M[s][rank] for s in range(P)], M[rank]
    return sorted([[receive, send], [send, receive]] * (calls // 2))


# ------------------------------------------------------------------------------------------------ the checks


def collect_dispatch(dispatch) -> dict:
    return {"ranks": list(parlab.launch(dispatch_rank, P, dispatch, **LAUNCH))}


def judge_dispatch(data) -> list[str]:
    ranks, ref = data["ranks"], shuffle_reference()
    inputs = [dispatch_inputs(r) for r in range(P)]
    grads = []
    for s in range(P):  # dL/dx of row i of rank s: the upstream weight of the row where it landed
        g = torch.zeros(ROWS[s], H, dtype=torch.float64)
        for i in range(ROWS[s]):
            d = owner(int(inputs[s][1][i]))
            g[i] = upstream(d, ref[d]["rows"].shape[0])[ref[d]["land"][(s, i)]]
        grads.append(g)
    lines = [
        compare("received rows, every rank", [r["received"] for r in ranks], [x["rows"] for x in ref]).line,
        compare(
            "received counts [P, E/P], every rank",
            [r["recv_counts"].reshape(P, PER).double() for r in ranks],
            [x["counts"].double() for x in ref],
        ).line,
        compare("gradient of x (backward), every rank", [r["grad"] for r in ranks], grads).line,
    ]
    wrong = sum(len(r["calls"]) != 3 or any(c[0] not in A2A for c in r["calls"]) for r in ranks)
    lines.append(
        check_equal("ranks not making exactly 3 all-to-alls (counts, rows; rows back) and nothing else", wrong, 0).line
    )
    M = [[sum(int(owner(int(e)) == d) for e in inputs[s][1]) for d in range(P)] for s in range(P)]
    wrong = sum(_row_splits(r["calls"]) != _expected_splits(M, rank, 2) for rank, r in enumerate(ranks))
    lines.append(
        check_equal(
            "ranks whose rows' split sizes (to and from each rank) are not the round-robin placement's",
            wrong,
            0,
        ).line
    )
    expected = [[E * 8, ROWS[r] * H * 8, ref[r]["rows"].shape[0] * H * 8] for r in range(P)]
    wrong = sum([b for b, _ in r["comm"]] != exp for r, exp in zip(ranks, expected, strict=True))
    lines.append(
        check_equal(
            "ranks whose all-to-all payloads (bytes) are not [counts, the rows it routes, the rows "
            "its experts received]",
            wrong,
            0,
        ).line
    )
    return lines


def collect_combine(combine) -> dict:
    return {"ranks": list(parlab.launch(layer_rank, P, combine, **LAUNCH))}


def _layer_lines(ranks: list[dict], ref: list[dict], what: str) -> list[str]:
    return [
        compare(f"{what}: output y, every rank", [r["y"] for r in ranks], [x["y"] for x in ref]).line,
        compare(
            f"{what}: gradients of x and of the gates, every rank",
            [[r["dx"], r["dgates"]] for r in ranks],
            [[x["dx"], x["dgates"]] for x in ref],
        ).line,
        compare(
            f"{what}: gradients of the experts' weights, every rank",
            [r["dW"] for r in ranks],
            [x["dW"] for x in ref],
        ).line,
    ]


def _float_payloads(rank: dict) -> tuple[int, int]:
    """(float64 bytes handed to all-to-alls, float64 bytes handed to any other call) by one rank."""
    floats = [(call[0], call[2]) for call in rank["calls"] if call[1] == "torch.float64"]
    a2a = sum(b for op, b in floats if op in A2A)
    return a2a, sum(b for _, b in floats) - a2a


def _traffic_lines(ranks: list[dict], ref: list[dict], what: str) -> list[str]:
    """The row all-to-alls' split sizes and float64 payload of every rank against the placement's."""
    M = split_matrix(ref)
    wrong = sum(_row_splits(r["calls"]) != _expected_splits(M, rank, 4) for rank, r in enumerate(ranks))
    lines = [
        check_equal(
            f"{what}: ranks whose rows' split sizes (dispatch, combine, and back) are not the round-robin placement's",
            wrong,
            0,
        ).line
    ]
    need = [2 * (sum(M[r]) + sum(M[s][r] for s in range(P))) * H * 8 for r in range(P)]
    wrong = sum(_float_payloads(r)[0] != n for r, n in zip(ranks, need, strict=True))
    lines.append(
        check_equal(
            f"{what}: ranks handing other float64 bytes to all-to-alls than their rows' (dropped rows must not travel)",
            wrong,
            0,
        ).line
    )
    return lines


def judge_combine(data) -> list[str]:
    ranks, ref = data["ranks"], layer_reference()
    lines = _layer_lines(ranks, ref, "MoE layer")
    wrong = sum(len(r["calls"]) != 5 or any(c[0] not in A2A for c in r["calls"]) for r in ranks)
    lines.append(
        check_equal(
            "ranks not making exactly 5 all-to-alls (counts, dispatch, combine; combine and "
            "dispatch backward) and nothing else",
            wrong,
            0,
        ).line
    )
    return lines + _traffic_lines(ranks, ref, "MoE layer")


def traffic_rank() -> dict:
    """Rank code: parlab's expert-parallel layer (lesson 09) on the routing of TRAFFIC_COUNTS, forward and backward,
    its experts renumbered so that its rank r holds the round-robin experts of rank r. Returns the payload this
    rank handed to its all-to-alls (parlab.core.comm's trace) and the float64 bytes that left it in the forward (the
    split sizes it handed over, less the rows it sent itself)."""
    from parlab.core.moe import MoE, MoEConfig, Routing
    from parlab.schemes.expert_parallel import ExpertParallelMoE

    rank = dist.get_rank()
    layout = sorted(range(E), key=lambda e: (owner(e), e))  # the library's expert i is round-robin expert layout[i]
    renumber = torch.tensor([layout.index(e) for e in range(E)])
    expert = torch.arange(E).repeat_interleave(torch.tensor(TRAFFIC_COUNTS[rank]))  # [n]: one row per assignment
    n = expert.numel()
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(400 + rank), dtype=torch.float64)
    x.requires_grad_()  # so that backward runs the dispatch's reverse shuffle too
    layer = ExpertParallelMoE(MoE(H, H, MoEConfig(experts=E, top_k=1)).double(), group=None)
    ones = torch.ones(n, 1, dtype=torch.float64)
    routing = Routing(renumber[expert].unsqueeze(1), ones, ones.bool(), torch.zeros(()), torch.bincount(expert))
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
    C, mine = TRAFFIC_COUNTS, experts_of(0)
    sent = sum(C[0])  # every row rank 0 routes goes out once in the dispatch
    received = sum(C[s][e] for s in range(P) for e in mine)  # rows for rank 0's experts, from every rank
    home = sum(C[0][e] for e in mine)  # rows rank 0 sends itself: they never leave it, nor come back over the wire
    payload = E * 8 + 2 * (sent + received) * H * 8  # counts; dispatch and combine, forward and backward
    wire = (sent - home + received - home) * H * 8  # forward: dispatch and combine, the rows to other ranks
    (p_pay, p_wire), (m_pay, m_wire) = data["predicted"], data["measured"]
    return prediction_lines(
        "payload rank 0 hands to all-to-alls, forward and backward", p_pay, payload, m_pay, rtol=0.005
    ) + prediction_lines("float64 bytes leaving rank 0, forward", p_wire, wire, m_wire, rtol=0.005)


def collect_capacity(keep_within_capacity, combine) -> dict:
    return {"ranks": list(parlab.launch(layer_rank, P, combine, keep_within_capacity, **LAUNCH))}


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
    masks = [r["keep"].reshape(TOKENS, K) for r in ranks]
    wrong = sum(not torch.equal(m, x["keep"]) for m, x in zip(masks, ref, strict=True))
    lines.append(check_equal("ranks whose kept assignments differ from one device's", wrong, 0).line)
    lines += _layer_lines(ranks, ref, f"capacity {CAPACITY}")
    lines += _traffic_lines(ranks, ref, f"capacity {CAPACITY}")
    wrong = sum(_float_payloads(r)[1] != 0 for r in ranks)
    lines.append(check_equal("ranks handing float64 data to other collectives", wrong, 0).line)
    return lines
