"""Lab 09's checks: the dispatch of expert parallelism without an all-to-all (pairwise exchanges in the fewest
rounds for the routing: counts in P - 1 rounds, then the rows, backward the other way), an MoE layer that sends each
token at most once to each rank, a prediction of the rounds of that layer's traffic on a 64-rank routing described
in words, and a capacity per expert over the whole group (first choices first) from counts exchanged within a
budget, on live ranks (see parlab/grading).

Every check runs on P = 4 ranks, E = 8 experts placed round-robin (expert e on rank e % P: rank r holds experts r
and r + 4, not the lesson's contiguous blocks), H = 6, float64. The experts are the lab model's MLP
(parlab/core/lab_model.py's SwiGLU, no biases: down(silu(gate x) * up x), width F = 8), not the lesson's. The inputs
are seeded and skewed: some experts get no rows, one rank sends none to some ranks, and a token's two experts often
live on the same rank (experts e and e + 4). Every call the ranks make into torch.distributed is recorded at the
process group (its op, dtype, shape and peer, when it was posted and when a wait on it returned: the rounds are
measured, not read from the order of the calls), and what went through parlab.core.comm from its trace; calls into the
library's own expert-parallel code, and into the checks' reference (parlab/grading/labs/lab09_reference.py: the
inputs of every rank, one device's results), are seen too (`LIBRARY`, parlab/grading/labs/guard.py). The judge
recomputes every reference on one device. A real deadlock (gloo's blocking send waits for its receive) is diagnosed
by parlab.launch within the launch timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import parlab
from parlab.core import comm, probe
from parlab.grading.labs import lab09_reference, prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab09_reference import (
    CAPACITY,
    CAPACITY_NUMBERS,
    FFN,
    PER,
    PREDICT_P,
    ROUTING,
    ROWS,
    TOKENS,
    E,
    H,
    K,
    P,
    degree,
    dispatch_inputs,
    expert_weights,
    experts_of,
    layer_inputs,
    layer_reference,
    owner,
    pair_matrix,
    rounds_theory,
    routing_pattern,
    shuffle_reference,
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
ROUTING_P = PREDICT_P  # the prediction's ranks (its experts: lab09_reference.PREDICT_E, round-robin)
ROW_BYTES = 8 * (H + E)  # the most bytes a float64 row of the part-2 layer may carry, per (token, destination):
# room for more than one layout of what travels with the token (the solution's needs 8 (H + 2 E/P))
THEORY = lab09_reference.THEORY  # the prediction's theory, one home (tests/test_lab_design.py reads it here)

STRUCTURAL = {
    "dispatch": "round-robin placement, uneven rows (a rank with none, a rank that receives none, experts with none): "
    "each rank's received rows (stacked by source rank, whatever round they came in), their counts per source and "
    "expert, and the gradient of x equal one device's shuffle; only point-to-point messages, each through "
    "parlab.core.comm, none to itself, no collective; each rank sends every other rank one int64 message of at most "
    "E numbers and, only when it has rows for it, one float64 message of exactly those rows, and in the backward one "
    "float64 message of the gradients of the rows it received from each source; each phase (counts, rows, backward) "
    "in real rounds measured from when each message was posted and when its wait returned (no rank with two sends or "
    "two receives in flight at once; each message joins one round of its sender and of its receiver) and in the "
    "fewest rounds one after another: P - 1 for the counts, the routing's most messages of one rank for the rows "
    "and the backward (the shifted schedule needs one more on this routing); the pure schedule(pattern) on 40 "
    "seeded patterns of 3 to 7 ranks in the kernel: every message once, each round one send and one receive per "
    "rank, the fewest rounds; no call into the library's expert-parallel or MoE code; a FAIL names the first rank, "
    "row, message or round with expected and received",
    "combine": "an MoE layer, top-2, round-robin placement, SwiGLU experts, one chosen gate exactly 0: the output, "
    "the gradients of x, of the gates and of every expert's gate, up and down weights (each held by one rank only) "
    "equal one device; only point-to-point messages (no collective); the float64 messages between every two ranks "
    f"carry one row per (token, destination rank) each way, forward and backward (a token whose two experts share a "
    f"rank travels there once), each row at most {ROW_BYTES} bytes; its int64 messages (the counts) at most "
    f"{E} numbers from a rank to each other rank in all; each expert multiplies in the forward exactly "
    "one row per assignment to it (counted from the matrix products with its gate matrix); no call into the "
    "library's code",
    "rounds": f"a routing of {PREDICT_P} ranks described in words (a hot rank, tokens that stay home): the rounds the "
    "token rows of one forward of the part-2 layer need in the fewest-rounds schedule and in the shifted one with "
    "empty shifts skipped, exactly; once right, the rounds of the answer's own schedule() on that routing are "
    "shown (not scored)",
    "capacity": f"a capacity of {CAPACITY} slots per expert over the whole group, the first choices before any "
    "second choice (GShard's priority), each in rank order, then token order: the kept assignments of every rank "
    "(a rank-order rule keeps others here), the output and all gradients equal one device's; the "
    f"mask made from point-to-point int64 messages only, each rank receiving at most {CAPACITY_NUMBERS} numbers "
    "and sending at most as many (room for a chain there and back, a scan, or everyone's counts to everyone; not "
    "for every row's experts to everyone); the values are not checked beyond the mask they give; the layer's "
    "float64 messages carry one row per (token, destination) of the kept assignments only, each expert runs its "
    "kept rows only; no collective; no call into the library's code",
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


class _Waited:
    """A process group's handle that notes in the log when a wait on it returns (the end of its message's flight)."""

    def __init__(self, work, log: list, index: int):
        self._work, self._log, self._index = work, log, index

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if ("done", self._index) not in self._log:
            self._log.append(("done", self._index))
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _recorder():
    """A context that records, for every process-group call, [op, dtype of its data, its shape, peer]: the data of
    a send or receive is its tensor and the peer its rank in the group; for an all-to-all the input; for any other
    call the first tensor it is handed (peer -1). And a log, in this rank's order, of ("post", i) when call i is
    made and ("done", i) when a wait on a send's or receive's handle returns (a blocking send or receive waits at
    once): what was in flight together, whatever the order of the calls. And `sent`: for each call, the numbers of
    an int64 send (what a rank tells another), None for any other call."""
    from torch._C._distributed_c10d import ProcessGroup

    calls: list[list] = []
    log: list[tuple[str, int]] = []
    sent: list[list[int] | None] = []
    names = [n for n in probe._methods(ProcessGroup) if not isinstance(getattr(ProcessGroup, n), type)]

    def wrap(name, original):
        def recorded(self, *args, **kwargs):
            tensors = probe._tensors(args[1] if name in ("all_to_all_single", "alltoall_base") else args[:1])
            peer = int(args[1]) if name in ("send", "recv") and len(args) > 1 else -1
            first = tensors[0] if tensors else torch.zeros(0)  # host: a stand-in for a call without data
            calls.append([name, str(first.dtype).removeprefix("torch."), list(first.shape), peer])
            told = name == "send" and first.dtype == torch.int64
            sent.append(first.detach().reshape(-1).tolist() if told else None)
            index = len(calls) - 1
            log.append(("post", index))
            work = original(self, *args, **kwargs)
            return _Waited(work, log, index) if name in P2P else work

        return recorded

    return probe.wrapped(ProcessGroup, {n: getattr(ProcessGroup, n) for n in names}, wrap), calls, log, sent


def _traced_p2p(calls_before: int) -> int:
    """This rank's sends and receives through parlab.core.comm since `calls_before`."""
    return sum(1 for e in comm.trace_events()[calls_before:] if e.kind in ("send", "recv"))


def dispatch_rank(dispatch) -> dict:
    rank = dist.get_rank()
    x, chosen = _on_device(*dispatch_inputs(rank))
    x.requires_grad_()
    start = len(comm.trace_events())
    context, calls, log, _ = _recorder()
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
        "recv_counts": torch.as_tensor(recv_counts).clone(),  # host: the student's counts, handed back to the check
        "order": torch.as_tensor(order).clone(),  # host: likewise
        "grad": grad.clone(),
        "forward": calls[:forward],
        "backward": calls[forward:],
        "calls": calls,
        "log": log,
        "traced": _traced_p2p(start),
        "library": list(called) + list(called_back),
    }


class _ExpertRows(TorchDispatchMode):
    """Counts, per expert, the rows its gate matrix multiplies: the multiply-adds of every matrix product with an
    operand that is (a view of) that matrix, divided by the F x H of one row. An expert run on a row it was not
    chosen for counts, whatever its gate."""

    PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self, gate_matrices: dict[int, torch.Tensor]):
        super().__init__()
        self.storage = {w.untyped_storage().data_ptr(): e for e, w in gate_matrices.items()}
        self.rows = {e: 0 for e in gate_matrices}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.PRODUCTS:
            a, b = (args[1], args[2]) if name.startswith(("addmm", "baddbmm")) else (args[0], args[1])
            for t in (a, b):
                e = self.storage.get(t.untyped_storage().data_ptr())
                if e is not None:
                    inner = a.shape[-1]
                    macs = a.numel() // inner * inner * b.shape[-1]
                    self.rows[e] += macs // (FFN * H)
        return func(*args, **(kwargs or {}))


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
    context, calls, _, sent = _recorder()
    counting = _ExpertRows({e: ws["gate"] for e, ws in weights.items()})
    with context:
        with library_calls(LIBRARY) as called:
            keep = torch.ones_like(flat, dtype=torch.bool)
            if keep_within is not None:
                keep = torch.as_tensor(keep_within(chosen.clone(), E, CAPACITY), device=flat.device).bool()
                keep = keep.reshape(-1)
            keeping = len(calls)
            with counting:  # the forward only: the backward multiplies by the same matrices again
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
        "keep_sent": sent[:keeping],
        "calls": calls[keeping:],
        "expert_rows": dict(counting.rows),
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
        if shape == ["<= E"]:
            parts.append(f"{dtype} x(at most {E})")
        else:
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


def _local_rounds(res: dict, phase: set[int], r: int) -> tuple[list[dict], str | None]:
    """One rank's rounds in one phase (the indices of its calls that belong to it), from its log: messages in flight
    together (a post before the wait of another returned) form one round, which may hold one send and one receive.
    Returns the rounds in order, each {"send": peer or None, "recv": peer or None}, or an error."""
    calls, position = res["calls"], {}
    for step, (what, i) in enumerate(e for e in res["log"] if e[1] in phase):
        position.setdefault(i, [None, None])[0 if what == "post" else 1] = step
    rounds, reach = [], -1
    for i in sorted(position, key=lambda i: position[i][0]):
        post, done = position[i]
        name, _, _, peer = calls[i]
        op = "send" if name == "send" else "recv"
        if done is None:
            return [], f"rank {r}: its {op} {'to' if op == 'send' else 'from'} rank {peer} is never waited for"
        if post > reach:
            rounds.append({"send": None, "recv": None})
        if rounds[-1][op] is not None:
            way = "sends to ranks" if op == "send" else "receives from ranks"
            return [], f"rank {r}: {way} {rounds[-1][op]} and {peer} in flight together (a round holds one of each)"
        rounds[-1][op] = peer
        reach = max(reach, done)
    return rounds, None


def _rounds(ranks: list[dict], phase: list[set[int]]) -> tuple[int, str | None]:
    """The rounds of one phase across the ranks: a message joins its sender's round and its receiver's round into
    one round of the group (the k-th send from s to d meets the k-th receive at d from s). Returns the number of
    rounds one after another the phase needs (the longest chain of rounds, each after the one before it on some
    rank), or an error: a rank in flight with two sends or two receives, two rounds of one rank joined, a cycle."""
    local = []
    for r, res in enumerate(ranks):
        rounds, error = _local_rounds(res, phase[r], r)
        if error:
            return 0, error
        local.append(rounds)
    parent: dict[tuple, tuple] = {}

    def root(node):
        while parent.get(node, node) != node:
            node = parent[node]
        return node

    def seen(r, op, peer):
        return [i for i, rd in enumerate(local[r]) if rd[op] == peer]

    for s in range(P):
        for d in range(P):
            sends, recvs = seen(s, "send", d), seen(d, "recv", s)
            if len(sends) != len(recvs):
                return 0, f"rank {s} sends rank {d} {len(sends)} messages, rank {d} receives {len(recvs)} from it"
            for i, j in zip(sends, recvs, strict=True):
                parent[root((s, i))] = root((d, j))
    members: dict[tuple, list] = {}
    for r in range(P):
        for i in range(len(local[r])):
            members.setdefault(root((r, i)), []).append((r, i))
    for group in members.values():
        ranks_in = [r for r, _ in group]
        for r in set(ranks_in):
            if ranks_in.count(r) > 1:
                rounds = [i + 1 for q, i in group if q == r]
                return 0, f"rank {r}'s rounds {rounds} are joined by its partners' messages into one round"
    depth: dict[tuple, int] = {}
    after = {key: set() for key in members}
    for r in range(P):
        for i in range(1, len(local[r])):
            after[root((r, i))].add(root((r, i - 1)))
    for _ in range(len(members) + 1):
        changed = False
        for key in members:
            value = 1 + max((depth.get(k, 0) for k in after[key]), default=0)
            if value > len(members):
                return 0, "the rounds wait for each other in a cycle"
            if depth.get(key) != value:
                depth[key], changed = value, True
        if not changed:
            break
    return max(depth.values(), default=0), None


def _phase_line(what: str, ranks: list[dict], phase: list[set[int]], fewest: int) -> str:
    """The verdict on one phase: real rounds (no rank with two sends or two receives in flight at once, each
    message in one round of both its ends), and as many one after another as the fewest possible."""
    got, error = _rounds(ranks, phase)
    if error:
        return f"{what}: not rounds: {error}: FAIL"
    if got != fewest:
        return f"{what}: expected {fewest} rounds one after another, received {got}: FAIL"
    return f"{what}: {got} rounds: PASS"


def _phase(res: dict, start: int, stop: int, dtype: str) -> set[int]:
    """The indices of a rank's sends and receives of `dtype` among its calls [start, stop)."""
    return {i for i in range(start, stop) if res["calls"][i][0] in P2P and res["calls"][i][1] == dtype}


# ------------------------------------------------------------------------------------------------ the checks


def schedule_patterns() -> list[list[list[bool]]]:
    """The patterns the check hands `schedule` in the kernel: seeded, 3 to 7 ranks, sparse to full (pattern[s][d]:
    s sends d one message; never s to itself)."""
    gen = torch.Generator().manual_seed(909)
    patterns = []
    for i in range(40):
        n = 3 + i % 5
        density = (0.2, 0.4, 0.6, 0.8, 1.0)[i // 8]
        draw = torch.rand(n, n, generator=gen) < density  # host: the seeded draw
        patterns.append([[bool(draw[s, d]) and s != d for d in range(n)] for s in range(n)])
    return patterns


def _schedule_error(pattern: list[list[bool]], rounds) -> str | None:
    """What is wrong with `rounds` as a schedule of `pattern` in the fewest rounds, or None."""
    n = len(pattern)
    edges = {(s, d) for s in range(n) for d in range(n) if pattern[s][d]}
    seen: list[tuple[int, int]] = []
    for k, pairs in enumerate(rounds):
        pairs = [(int(s), int(d)) for s, d in pairs]
        senders, receivers = [s for s, _ in pairs], [d for _, d in pairs]
        for who, what in ((senders, "sends"), (receivers, "receives")):
            twice = sorted({r for r in who if who.count(r) > 1})
            if twice:
                return f"round {k + 1}: rank {twice[0]} {what} twice"
        seen += pairs
    extra = [e for e in seen if e not in edges]
    if extra:
        return f"a message {extra[0][0]} -> {extra[0][1]} the pattern does not have"
    missing = sorted(edges - set(seen))
    if missing:
        return f"no round for the message {missing[0][0]} -> {missing[0][1]}"
    if len(seen) != len(set(seen)):
        return "a message in two rounds"
    if len(rounds) != degree(pattern):
        return f"{len(rounds)} rounds, expected {degree(pattern)} (the fewest)"
    return None


def collect_dispatch(dispatch, schedule) -> dict:
    answers = []
    with library_calls(LIBRARY) as called:  # in the kernel: the pure schedule, on many patterns
        for pattern in schedule_patterns():
            try:
                answers.append(schedule([row[:] for row in pattern]))
            except Exception as exc:  # noqa: BLE001 (any failure of the answer)
                answers.append(f"raised {type(exc).__name__}: {exc}")
    verdicts = []
    for pattern, answer in zip(schedule_patterns(), answers, strict=True):
        try:  # judged outside the guard: the checks' own reference is on LIBRARY
            verdicts.append(answer if isinstance(answer, str) else _schedule_error(pattern, answer))
        except Exception as exc:  # noqa: BLE001 (an answer of the wrong shape)
            verdicts.append(f"not a list of rounds of (s, d) pairs ({type(exc).__name__})")
    ranks = list(parlab.launch(dispatch_rank, P, dispatch, **LAUNCH))
    return {"ranks": ranks, "schedules": verdicts, "kernel_library": list(called)}


def _counts(t: torch.Tensor) -> list:
    """Received counts as [P, E/P] when they have that many, else as they came."""
    t = t.reshape(-1).cpu()
    return t.reshape(P, PER).tolist() if t.numel() == P * PER else t.tolist()


def _at_most(message: list) -> list:
    """An int64 message of at most E numbers shown as such (its exact size is the answer's design)."""
    dtype, shape, peer = message
    return [dtype, ["<= E"], peer] if dtype == "int64" and _numel(shape) <= E else message


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
            sent = [_at_most(m) for m in _messages(res["forward"], "send") if m[2] == d]
            got = [_at_most(m) for m in _messages(res["forward"], "recv") if m[2] == d]
            counts_msg = [["int64", ["<= E"], -1]]
            forward.append((f"rank {r} to rank {d}", _shown(counts_msg + wanted(M[r][d])), _shown(sent)))
            forward.append((f"rank {r} from rank {d}", _shown(counts_msg + wanted(M[d][r])), _shown(got)))
            sent = [m for m in _messages(res["backward"], "send") if m[2] == d]
            got = [m for m in _messages(res["backward"], "recv") if m[2] == d]
            backward.append((f"rank {r} to rank {d}", _shown(wanted(M[d][r])), _shown(sent)))
            backward.append((f"rank {r} from rank {d}", _shown(wanted(M[r][d])), _shown(got)))
    what = "forward messages between every two ranks: one int64 message of at most E numbers, then the rows if any"
    lines.append(first_difference(what, forward))
    what = "backward messages between every two ranks: the gradients of the rows, back to where they came from"
    lines.append(first_difference(what, backward))
    fewest = degree([[M[s][d] > 0 and s != d for d in range(P)] for s in range(P)])
    phases = (
        (
            "the counts (int64, every pair): rounds of one send and one receive per rank, the fewest",
            0,
            "forward",
            "int64",
            P - 1,
        ),
        (
            "the rows (float64, pairs with rows only): rounds, the fewest for this routing",
            0,
            "forward",
            "float64",
            fewest,
        ),
        ("the backward (float64): rounds, the fewest for this routing", 1, "backward", "float64", fewest),
    )
    for what, after, key, dtype, least in phases:
        phase = []
        for res in ranks:
            start = len(res["forward"]) * after
            phase.append(_phase(res, start, start + len(res[key]), dtype))
        lines.append(_phase_line(what, ranks, phase, least))
    wrong = [(i, v) for i, v in enumerate(data["schedules"]) if v is not None]
    what = f"schedule(pattern) in the kernel, {len(data['schedules'])} seeded patterns of 3 to 7 ranks"
    if wrong:
        i, error = wrong[0]
        pattern = schedule_patterns()[i]
        shown = [[d for d in range(len(pattern)) if pattern[s][d]] for s in range(len(pattern))]
        lines.append(f"{what}: {len(wrong)} wrong; first pattern {i} (rank s sends to {shown}): {error}: FAIL")
    else:
        lines.append(f"{what}: each round one send and one receive per rank, every message once, fewest rounds: PASS")
    called = data["kernel_library"] + [n for res in ranks for n in res["library"]]
    lines.append(library_line("dispatch", called, WHAT))
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
    them). The int64 messages (the counts) carry at most E numbers from a rank to each other rank, in all."""
    M, items, widths, counts = pair_matrix(ref), [], [], []
    for r, res in enumerate(ranks):
        sent = [m for m in _messages(res["calls"], "send", "float64") if _numel(m[1])]
        for d in range(P):
            if d == r:
                continue
            expected = sorted([M[r][d]] * 2 * (M[r][d] > 0) + [M[d][r]] * 2 * (M[d][r] > 0))
            got = sorted(shape[0] if len(shape) == 2 else _numel(shape) for _, shape, peer in sent if peer == d)
            items.append((f"rank {r} to rank {d}", f"messages of {expected} rows", f"messages of {got} rows"))
        told = {}
        for _, shape, peer in _messages(res["calls"], "send", "int64"):
            told[peer] = told.get(peer, 0) + _numel(shape)
        bound = f"int64: at most {E} numbers to each other rank"
        over = [(peer, n) for peer, n in sorted(told.items()) if n > E or peer == r]
        counts.append((f"rank {r}", bound, f"{over[0][1]} numbers to rank {over[0][0]}" if over else bound))
        bad = [shape for _, shape, _ in sent if len(shape) != 2 or not H <= shape[1] <= ROW_BYTES // 8]
        fine = f"rows of {8 * H} to {ROW_BYTES} bytes"
        shown = f"a message of shape {bad[0]} ({8 * bad[0][-1]} bytes a row)" if bad else fine
        widths.append((f"rank {r}", fine, shown))
    return [
        first_difference(
            f"{what}: float64 messages between every two ranks, forward and backward: one row per (token, "
            "destination rank) each way",
            items,
        ),
        first_difference(
            f"{what}: every float64 message: rows of at least the token's {8 * H} bytes, at most {ROW_BYTES}", widths
        ),
        first_difference(f"{what}: the counts, every rank's int64 sends, forward and backward", counts),
        _expert_rows_line(ranks, ref, what),
    ]


def _expert_rows_line(ranks: list[dict], ref: list[dict], what: str) -> str:
    """Each expert multiplies (in the forward) one row per kept assignment to it, none for a row that did not choose
    it: counted from the matrix products with its gate matrix."""
    items = []
    for r, res in enumerate(ranks):
        for e in experts_of(r):
            wanted = sum(int(((x["chosen"] == e) & x["keep"]).sum()) for x in ref)
            got = res["expert_rows"].get(e, 0)
            items.append((f"expert {e} (rank {r})", f"{wanted} rows", f"{got} rows"))
    return first_difference(f"{what}: rows each expert ran in the forward (one per kept assignment to it)", items)


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


def collect_rounds(rounds_fewest, rounds_shifted, schedule) -> dict:
    pattern = routing_pattern(ROUTING, ROUTING_P)
    try:  # shown, not scored: a schedule that is not written yet costs the prediction nothing
        with library_calls(LIBRARY) as called:
            measured = len(schedule([row[:] for row in pattern]))
        if called:
            measured = "not measured: your schedule calls the library"
    except Exception as exc:  # noqa: BLE001 (any failure of the answer's schedule)
        measured = f"not measured: your schedule failed ({type(exc).__name__})"
    return {"predicted": [rounds_fewest, rounds_shifted], "measured": measured}


def judge_rounds(data) -> list[str]:
    theory = rounds_theory()
    (fewest, shifted), measured = data["predicted"], data["measured"]
    label = f"rounds of the token rows of one forward of the part-2 layer, {ROUTING_P} ranks"
    lines = prediction_lines(f"{label}, the fewest", fewest, theory["rounds_fewest"], rtol=0)
    lines += prediction_lines(f"{label}, shifted, empty shifts skipped", shifted, theory["rounds_shifted"], rtol=0)
    if lines[1].endswith("PASS"):  # shown once the prediction is right, as the theory is
        shown = f"{measured} rounds" if isinstance(measured, int) else measured
        lines.append(f"{label}: your schedule() on this routing's pattern: {shown}")
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
        n = CAPACITY_NUMBERS
        expected = f"int64 messages only, at most {n} numbers in and {n} out"
        shown = f"also {others[:3]}" if others else f"{got} numbers in, {sent} out"
        least.append((f"rank {r}", expected, expected if not others and got <= n and sent <= n else shown))
    lines.append(first_difference("the mask: what each rank learns from the others, int64 numbers in and out", least))
    lines += _layer_lines(ranks, ref, f"capacity {CAPACITY}")
    lines.append(
        _only_p2p(ranks, "calls", f"capacity {CAPACITY}: calls of the layer, every rank: sends and receives only")
    )
    lines += _traffic_lines(ranks, ref, f"capacity {CAPACITY}")
    lines.append(library_line("capacity", [n for res in ranks for n in res["library"]], WHAT))
    return lines
