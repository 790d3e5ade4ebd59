"""Lab 00's checks: a ring reduce-scatter of sparse gradients to an owner map over a given ring order, a
bidirectional ring all-reduce, an all-reduce across nodes designed for the fewest bytes between them, a prediction of
what a flat ring sends between nodes, and an all-reduce in log-many rounds for any number of ranks, on live ranks (see
parlab/grading/__init__.py for the scheme).

Beyond "every rank holds the right sum", each check verifies from what the ranks handed to torch.distributed
(parlab.core.probe) that the sum was computed by the student's own messages. The rings are checked message by
message against *properties*, not against a schedule written out here: every message a rank sends must be a partial
sum of a piece of x over exactly the ranks its ring has combined by then (the ranks before it on its ring), of whole
pieces, to the right rank, and the pieces must finish where the task says; the sparse reduce-scatter's messages must
also carry no partial sum still all zero, and none may be empty. Which piece goes when is the student's to work
out: a FAIL line says which message is wrong, what it should be a sum over, and what it held (which piece, summed
over which ranks), never which piece was due. The all-reduce across nodes is a design: it is checked against the
least bytes between nodes any all-reduce can send, the least any all-reduce can put on the busiest network port, and
a cap inside the nodes. The log-rounds all-reduce is checked by its rounds and bytes against budgets. Calls into the
library's ring (parlab/schemes/collectives.py, lesson 00's helpers) or into this module are seen too
(parlab/grading/labs/guard.py).
"""

from __future__ import annotations

import functools
import itertools
import math
import time

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.grading.labs import p2p_events, prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a send nobody receives) is diagnosed in ~2 s; 60 s stops the rest
# What the answers must not call: the library's ring and lesson 00's helpers, and this module.
LIBRARY = ("schemes/collectives.py", "lessons/collectives.py", "grading/labs/lab00_ring_allreduce.py")
# Part 1: ring[m] sends to ring[m+1]; x cut into pieces of these sizes (a model's gradients, e.g. embedding rows),
# piece k owned by rank owner[k]; touched[q][k]: rank q's tokens touched piece k (its gradient there is all zero
# otherwise). Ranks own several pieces, scattered through x; on [2, 1, 0] rank 1 owns none. Pieces touched by their
# owner alone or by nobody, pieces that enter the ring several ranks after their owner, a rank that touched nothing.
RS_CASES = [
    {
        "ring": [0, 2, 3, 1],
        "sizes": [300, 7, 250, 120, 90, 233],
        "owner": [1, 3, 0, 1, 2, 0],
        "touched": [[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0]],
    },
    {
        "ring": [2, 1, 0],
        "sizes": [4, 3, 6, 5],
        "owner": [2, 0, 2, 2],
        "touched": [[1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 0, 1]],
    },
    {
        "ring": [3, 0, 4, 2, 1],
        "sizes": [2, 5, 1, 3, 4, 7, 6, 8],
        "owner": [4, 0, 4, 1, 3, 2, 0, 3],
        "touched": [
            [1, 0, 0, 1, 0, 0, 1, 0],
            [0, 0, 1, 1, 0, 1, 0, 0],
            [1, 0, 0, 0, 1, 0, 0, 1],
            [0, 1, 0, 0, 0, 1, 0, 1],
            [0, 0, 0, 0, 0, 0, 0, 0],
        ],
    },
]
BIDIRECTIONAL_CASES = [
    (4, 1001),
    (5, 23),
    (2, 13),
]  # (P, N), N not a multiple of 2P; on 2 ranks both neighbours are one rank
NODE_LAYOUTS = {  # name: (nodes, N); nodes[g] = the global ranks of node g
    "2 nodes x 2 ranks": ([[0, 1], [2, 3]], 1000),
    "3 nodes x 2 ranks, dealt round-robin": ([[0, 3], [1, 4], [2, 5]], 12),
    "nodes of 3 and 2 ranks, dealt round-robin": ([[0, 2, 4], [1, 3]], 10),
    # Three nodes of different sizes: an even split of the work across nodes overloads the small node's ports.
    "nodes of 3, 3 and 2 ranks, dealt round-robin": ([[0, 3, 6], [1, 4, 7], [2, 5]], 48),
}
# The prediction: 8 ranks dealt round-robin over 3 nodes of 3, 3 and 2 ranks, and a model's gradients in pieces of
# these sizes owned by these ranks (rank 2 owns none; float64, every rank touches every piece): a flat ring all-reduce
# of them (part 1's reduce-scatter, then the all-gather round the same ring) on a ring order of the student's choosing.
CROSS_NODES = [[0, 3, 6], [1, 4, 7], [2, 5]]
CROSS_SIZES = [200, 95, 333, 150, 512, 128, 210, 120, 301]
CROSS_OWNER = [0, 1, 3, 4, 5, 6, 0, 4, 7]
# (P, N): any P, N not a multiple of the largest power of two <= P (chunk rounding; on 9 ranks N = 9, where cutting
# blocks in halves rounds up at every step) except on 8 ranks, where the ring's bytes are exactly 2(P-1)/P N per rank.
HALVING_CASES = [(3, 1001), (5, 999), (6, 1002), (9, 9), (8, 1000)]

STRUCTURAL = {
    "reduce_scatter": "rings [0, 2, 3, 1], [2, 1, 0] and [3, 0, 4, 2, 1], x cut into pieces of uneven sizes with an "
    "owner map (ranks owning several pieces scattered through x, one rank owning none) and a map of which rank "
    "touched which piece (its gradient all zero elsewhere; pieces touched by their owner alone or by nobody, pieces "
    "first touched several ranks after their owner, a rank that touched nothing): piece k summed over all ranks on "
    "rank owner[k] (a FAIL says whose sum it holds); every rank sends at most P-1 messages, none empty, only to the "
    "next rank of the ring, and receives only from the previous one; every message is whole pieces in any order, "
    "each one the rank does not own, sent once, summed over exactly the ranks it has passed through since its owner, "
    "and no longer all zero (a FAIL names the first message: what it held, zeros included); bytes per rank: the "
    "least, each piece whose partial sum is non-zero when it reaches the rank, once; no library collective, no call "
    "into the library's ring or this module",
    "bidirectional": "P=4, N=1001; P=5, N=23; P=2, N=13 (N never a multiple of 2P; on 2 ranks both neighbours are "
    "one rank): the sum on every rank; at most 2(P-1) steps, each a non-empty message to each neighbour and a receive "
    "from each, the four issued before any is waited for (parlab.core.comm's trace), nothing to or from other ranks; "
    "each rank's bytes at most 2(N - floor(N/P)) (the one-way ring's busiest rank); each link direction at most "
    "N - floor(N/P) + P - 1 (half the one-way ring's busiest link, plus half an element per message for odd cuts); "
    "which data goes which way and where it finishes is not checked",
    "hierarchical": "four node layouts (2x2; 3 nodes of 2 dealt round-robin; nodes of 3 and 2 dealt round-robin, "
    "where local ranks do not pair up; nodes of 3, 3 and 2 dealt round-robin, N=48, where an even split of the work "
    "across nodes overloads the small node's ports): the sum on every rank; the bytes sent between nodes, all nodes "
    "together, equal to the least any all-reduce needs (2(G-1) N elements: every element must reach each of G nodes "
    "and be reduced from them); the busiest rank's bytes to and from other nodes equal to the least possible (the "
    "lower bound max(ceil(N / smallest node), ceil(2(G-1)N / P)), met on these layouts); inside each node no rank "
    "sends more "
    "than a ring all-reduce of the node would, 2(L-1) ceil(N/L) elements; no library collective or library ring",
    "cross_node_bytes": "a flat ring all-reduce (part 1's reduce-scatter then the all-gather round the same ring) "
    "of pieces of uneven sizes with an owner map (rank 2 owns none), float64, on 8 ranks dealt round-robin over nodes "
    "of 3, 3 and 2 ranks, bytes sent between nodes, all nodes together: the student's ring is one on which the fewest "
    "cross of all 5040 ring orders (searched exhaustively, no number printed); the predicted fewest equals that least "
    "(exactly); the student's own reduce-scatter measured on their ring (shown once all is right)",
    "halving_doubling": "P=3, 5, 6, 9 (N not a multiple of the largest power of two P' <= P; on 9 ranks N=9, where "
    "cutting blocks in halves rounds) and 8: the sum on every rank; rounds of messages per rank (a round: one send "
    "and/or one receive with one partner, counted in the order posted) at most 2 floor(log2 P) + 2, exactly 2 log2 P "
    "on 8 ranks; bytes: on 3, 5, 6 and 9 ranks the busiest rank at most N + 2(N - floor(N/P')) + log2 P' elements "
    "(halving_bytes: what any fold-in/fold-out design with even halves needs, derived there, simulated for P <= 32 in "
    "tests/test_lab00_halving_budget.py), on 8 ranks every rank exactly 2(P-1)/P N; no library collective or library "
    "code (a FAIL says expected vs measured, no formula)",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def rank_input(rank: int, numel: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What rank `rank` contributes: [numel], drawn from a seed so the parent can redraw it."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)  # host: the seeded draw
    return x.to(dtype)


# ----------------------------------------------------------------- what a message holds: a piece, summed over ranks


def _inputs(world: int, numel: int) -> list[torch.Tensor]:
    return [rank_input(q, numel) for q in range(world)]


def _over(ranks, world: int) -> str:
    ranks = sorted(ranks)
    return "all ranks" if len(ranks) == world else f"rank {ranks[0]} alone" if len(ranks) == 1 else f"ranks {ranks}"


def _same(value: torch.Tensor, expected: torch.Tensor) -> bool:
    return value.shape == expected.shape and torch.allclose(value.to(torch.float64), expected, rtol=0, atol=1e-10)


def holds(value, world: int, units: dict[str, list[torch.Tensor]]) -> str:
    """What a message holds, if it is some piece summed over some ranks: "chunk 3 summed over ranks [0, 2]"."""
    if not isinstance(value, torch.Tensor):
        return "nothing readable"
    value = value.flatten().to(torch.float64)
    if value.numel() and not value.any():
        return f"{value.numel()} zeros"
    for name, per_rank in units.items():
        if per_rank[0].numel() != value.numel():
            continue
        for size in range(1, world + 1):
            for subset in itertools.combinations(range(world), size):
                if _same(value, sum(per_rank[q] for q in subset)):
                    return f"{name} summed over {_over(subset, world)}"
    shown = ", ".join(f"{v:.4g}" for v in value[:3].tolist())
    return f"no partial sum of any piece ({value.numel()} values: {shown}{', ...' if value.numel() > 3 else ''})"


def _sends(calls) -> list[dict]:
    return [c for c in calls if c["op"] == "send"]


def _receives(calls) -> list[dict]:
    return [c for c in calls if c["op"] in probe.P2P and c["op"] != "send"]


def collective_line(case: str, ranks: list[dict]) -> str:
    """No rank called a library collective (all-reduce & co., seen at the process group)."""
    found = [(r, sorted(set(probe.library_collectives(res["calls"])))) for r, res in enumerate(ranks)]
    found = [f"rank {r} called library collective(s) {ops}" for r, ops in found if ops]
    what = f"{case}no library collective on any rank, only isend/irecv"
    return f"{what}: PASS" if not found else f"{what}: {'; '.join(found[:2])}: FAIL"


def guard_line(case: str, ranks: list[dict]) -> str:
    # An import runs a module's body (<module>): not a call. A comprehension or lambda inside a function that was
    # called adds nothing to that function's name.
    called = [name for res in ranks for name in res.get("library", [])]
    called = [name for name in called if not name.endswith(": <module>") and ".<locals>.<" not in name]
    return library_line(f"{case}your code", called, "the library's ring or this lab's checks")


def bytes_line(case: str, measured: list[int], theory: list[int], what: str = "bytes each rank sent") -> str:
    for r, (m, t) in enumerate(zip(measured, theory, strict=True)):
        if m != t:
            return f"{case}{what}: rank {r}: measured {m} != theory {t}: FAIL"
    return f"{case}{what}: measured {measured} = theory {theory}: PASS"


def sum_line(case: str, what: str, got: list, expected: list[torch.Tensor], names: list[str], units=None) -> str:
    """The results against the single-device sum; a FAIL names the first wrong rank: element, expected, received
    (and, given `units`, which partial sum it holds)."""
    for name, a, b in zip(names, got, expected, strict=True):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            came = f"shape {list(a.shape)}" if isinstance(a, torch.Tensor) else repr(a)[:40]
            return f"{case}{what}: {name}: expected {b.numel()} values, received {came}: FAIL"
        if not torch.allclose(a.to(torch.float64), b, rtol=0, atol=1e-10):
            i = int((a.to(torch.float64) - b).abs().argmax())
            held = f" (it holds {holds(a, len(names), units)})" if units else ""
            return (
                f"{case}{what}: {name}: element {i}: expected {b[i].item():.6g}, received {a[i].item():.6g}{held}: FAIL"
            )
    return compare(f"{case}{what}", got, expected).line


def _record(answer, *args) -> dict:
    """Rank side: run the answer with every process-group call recorded (peers as global ranks) and library calls
    watched; the traced sends and receives it issued, [kind, peer, issued at, waited for at (-1: never)]."""
    since = time.perf_counter()
    with probe.recording(with_groups=True) as calls, library_calls(LIBRARY) as called:
        out = answer(*args)
    events = [[e["kind"], e["peer"], e["start"], e["end"]] for e in p2p_events(since)]
    for c in calls:
        c.pop("group", None)
    return {"out": out, "calls": calls, "library": list(called), "events": events}


def _run_whole(answer, numel: int, *args) -> dict:
    """Rank side: the answer run on this rank's input x [numel]; what it returned and what it did."""
    x = rank_input(dist.get_rank(), numel).to(parlab.device())
    result = _record(answer, x.clone(), *args)
    out = result["out"]
    result["out"] = out.detach().cpu() if isinstance(out, torch.Tensor) else repr(out)[:80]
    return result


def _whole_lines(case: str, ranks: list[dict], world: int, numel: int) -> list[str]:
    total = sum(_inputs(world, numel))
    names = [f"rank {r}" for r in range(world)]
    return [
        collective_line(case, ranks),
        sum_line(case, "the all-reduce on every rank", [res["out"] for res in ranks], [total] * world, names),
    ]


def _sizes(numel: int, parts: int) -> list[int]:
    """The sizes of tensor_split(parts) on numel elements: the first numel % parts one longer."""
    q, extra = divmod(numel, parts)
    return [q + (i < extra) for i in range(parts)]


# --------------------------------------------------------------- 1 · a reduce-scatter to owners, on a given ring


def _pieces(case: dict, rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s pieces in a part-1 case: its x [sum of sizes] cut into pieces of the given sizes, the pieces
    it did not touch all zero."""
    pieces = rank_input(rank, sum(case["sizes"])).split(case["sizes"])
    return [p * bool(t) for p, t in zip(pieces, case["touched"][rank], strict=True)]


def _run_reduce_scatter(phase, case: dict) -> dict:
    pieces = [p.to(parlab.device()) for p in _pieces(case, dist.get_rank())]
    touched = [[bool(t) for t in row] for row in case["touched"]]
    result = _record(phase, pieces, list(case["owner"]), list(case["ring"]), touched)
    return {"pieces": [p.cpu() for p in pieces], "calls": result["calls"], "library": result["library"]}


def collect_reduce_scatter(reduce_scatter_phase) -> dict:
    runs = [
        list(parlab.launch(_run_reduce_scatter, len(c["ring"]), reduce_scatter_phase, c, **LAUNCH)) for c in RS_CASES
    ]
    return {"ranks": runs[0], "more": runs[1:]}


def _arc(ring: list[int], start: int, end: int) -> frozenset[int]:
    """The ranks of `ring` from `start` to `end` going round it, both included."""
    P, m = len(ring), ring.index(start)
    out = [start]
    while out[-1] != end:
        m = (m + 1) % P
        out.append(ring[m])
    return frozenset(out)


def passed(case: dict, k: int, sender: int) -> frozenset[int]:
    """The ranks piece k has passed through when `sender` sends it on: a ring reduce-scatter must finish it on its
    owner after every other rank, so it starts on the rank after its owner and gains one rank per hop (the ranks
    that did not touch it add zeros)."""
    ring = case["ring"]
    after_owner = ring[(ring.index(case["owner"][k]) + 1) % len(ring)]
    return _arc(ring, after_owner, sender)


def nonzero(case: dict, k: int, sender: int) -> bool:
    """Whether piece k's partial sum is no longer all zero when `sender` would send it: a rank it has passed through
    touched it."""
    return sender != case["owner"][k] and any(case["touched"][q][k] for q in passed(case, k, sender))


def least_rs_bytes(case: dict) -> list[int]:
    """Each rank's bytes in a reduce-scatter that sends no partial sum still all zero, float64: every piece it does
    not own whose partial sum is non-zero when it reaches it, once."""
    P = len(case["ring"])
    return [8 * sum(n for k, n in enumerate(case["sizes"]) if nonzero(case, k, r)) for r in range(P)]


def _piece_prefix(value: torch.Tensor, at: int, world: int, units: dict) -> str:
    """What the values from `at` on start with: some piece summed over some ranks, zeros, or nothing
    recognisable."""
    for name, per_rank in units.items():
        n = per_rank[0].numel()
        if at + n > value.numel():
            continue
        if not value[at : at + n].any():
            return f"{n} zeros (the size of {name}): a partial sum still all zero"
        for size in range(1, world + 1):
            for subset in itertools.combinations(range(world), size):
                if _same(value[at : at + n], sum(per_rank[q] for q in subset)):
                    return f"{name} summed over {_over(subset, world)}"
    return f"no partial sum of any piece ({value.numel() - at} values left)"


def rs_messages_line(case: dict, label: str, ranks: list[dict], units: dict) -> str:
    """Every message a rank sends: to the next rank of the ring, at most P-1 of them, none empty, each whole pieces
    (any order), each summed over exactly the ranks it has passed through since its owner (passed()) and no longer
    all zero (nonzero()), none sent twice."""
    ring, world = case["ring"], len(case["ring"])
    what = (
        f"{label}at most P-1 messages, none empty, to the next rank of the ring, each whole pieces summed over "
        "exactly the ranks they have passed through, none still all zero"
    )
    names = list(units)
    for r in range(world):
        right = ring[(ring.index(r) + 1) % world]
        sends, sent = _sends(ranks[r]["calls"]), set()
        if len(sends) > world - 1:
            return f"{what}: rank {r} sent {len(sends)} messages, a ring has {world - 1} steps: FAIL"
        for i, call in enumerate(sends):
            if int(call["peer"]) != right:
                return f"{what}: rank {r}, message {i} went to rank {call['peer']}, not to rank {right}: FAIL"
            value = call.get("data")
            if not isinstance(value, torch.Tensor):
                return f"{what}: rank {r}, message {i}: nothing readable: FAIL"
            value, at = value.flatten().to(torch.float64), 0
            if not value.numel():
                return (
                    f"{what}: rank {r}, message {i} (to rank {right}): expected at least one piece summed over the "
                    "ranks it has passed through, received an empty message: FAIL"
                )
            while at < value.numel():
                k = next(
                    (
                        k
                        for k in range(len(names))
                        if k not in sent
                        and nonzero(case, k, r)
                        and at + units[names[k]][0].numel() <= value.numel()
                        and _same(
                            value[at : at + units[names[k]][0].numel()],
                            sum(units[names[k]][q] for q in passed(case, k, r)),
                        )
                    ),
                    None,
                )
                if k is None:
                    came = _piece_prefix(value, at, world, units)
                    return (
                        f"{what}: rank {r}, message {i} (to rank {right}), from value {at} on: expected a piece it "
                        f"does not own, not sent before, summed over the ranks it has passed through, not all zero; "
                        f"received {came}: FAIL"
                    )
                sent.add(k)
                at += units[names[k]][0].numel()
    return f"{what}: PASS"


def judge_reduce_scatter(data) -> list[str]:
    lines = []
    runs = [data["ranks"], *data.get("more", [None] * (len(RS_CASES) - 1))]
    for c, ranks in zip(RS_CASES, runs, strict=True):
        ring, sizes, owner = c["ring"], c["sizes"], c["owner"]
        world = len(ring)
        case = f"ring {ring}, owners {owner}: "
        if ranks is None:  # the grader always collects it; a hand-made dict may lack it
            lines.append(f"{case}the ranks' results: missing: FAIL")
            continue
        per_rank = [_pieces(c, q) for q in range(world)]
        units = {f"piece {k}": [per_rank[q][k] for q in range(world)] for k in range(len(sizes))}
        what = "piece k summed over all ranks on rank owner[k]"
        sums = f"{case}{what}: PASS"
        for k, o in enumerate(owner):
            got = ranks[o]["pieces"][k] if len(ranks[o]["pieces"]) > k else None
            want = sum(units[f"piece {k}"])
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                sums = (
                    f"{case}{what}: piece {k} on rank {o}: expected {want.numel()} values, received {got!r:.40}: FAIL"
                )
                break
            if not _same(got, want):
                i = int((got.to(torch.float64) - want).abs().argmax())
                sums = (
                    f"{case}{what}: piece {k} on rank {o}: value {i}: expected {want[i].item():.6g}, received "
                    f"{got[i].item():.6g} (it holds {holds(got, world, {f'piece {k}': units[f'piece {k}']})}): FAIL"
                )
                break
        left = [ring[(ring.index(r) - 1) % world] for r in range(world)]
        stray = [
            (r, int(v["peer"])) for r in range(world) for v in _receives(ranks[r]["calls"]) if int(v["peer"]) != left[r]
        ]
        recv_what = f"{case}receives only from the previous rank of the ring"
        lines += [
            collective_line(case, ranks),
            sums,
            f"{recv_what}: PASS"
            if not stray
            else f"{recv_what}: rank {stray[0][0]} received from rank {stray[0][1]}, not from rank "
            f"{left[stray[0][0]]}: FAIL",
            rs_messages_line(c, case, ranks, units),
            bytes_line(
                case,
                [probe.total_bytes(res["calls"], "send") for res in ranks],
                least_rs_bytes(c),
                "bytes each rank sent (no partial sum still all zero)",
            ),
            guard_line(case, ranks),
        ]
    return lines


# ------------------------------------------------------------------------------- 2 · the bidirectional ring


def collect_bidirectional(bidirectional_all_reduce) -> dict:
    runs = {}
    for world, numel in BIDIRECTIONAL_CASES:
        runs[f"{world},{numel}"] = list(parlab.launch(_run_whole, world, bidirectional_all_reduce, numel, **LAUNCH))
    return {"runs": runs}


def two_way_budgets(world: int, numel: int) -> tuple[int, int]:
    """Elements, the most a rank may send in all and the most on one link in one direction.

    The one-way ring: rank r sends every chunk (x.tensor_split(P)) but its own in the reduce-scatter and every
    chunk but the next rank's in the all-gather, 2N - c_r - c_{r+1} <= 2(N - floor(N/P)), all of it on its one
    outgoing link. Both ways round, a rank may send no more in all, and each link in each direction carries at most
    half of it, plus half an element for each of the 2(P-1) messages a direction carries where a piece of odd length
    is cut in two: N - floor(N/P) + P - 1."""
    ring = 2 * (numel - numel // world)
    return ring, ring // 2 + world - 1


def steps_line(case: str, ranks: list[dict], world: int) -> str:
    """At most 2(P-1) steps; at every step one non-empty message to each neighbour and one receive from each (in
    the order of posting: on 2 ranks both neighbours are one rank), and nothing to or from any other rank."""
    what = f"{case}at most 2(P-1) steps, each a message to both neighbours and a receive from both, none empty"
    for r, res in enumerate(ranks):
        ends = {(r - 1) % world, (r + 1) % world}
        sends, receives = _sends(res["calls"]), _receives(res["calls"])
        stray = [c for c in sends + receives if int(c["peer"]) not in ends]
        if stray:
            return f"{what}: rank {r} exchanged with rank {stray[0]['peer']}, not a neighbour: FAIL"
        if len(sends) != len(receives) or len(sends) % 2:
            return (
                f"{what}: rank {r}: expected as many receives as sends, two a step, sent {len(sends)} and received "
                f"{len(receives)}: FAIL"
            )
        if len(sends) // 2 > 2 * (world - 1):
            return f"{what}: rank {r}: expected at most {2 * (world - 1)} steps, took {len(sends) // 2}: FAIL"
        for k in range(len(sends) // 2):
            for kind, pair in (("sent to", sends[2 * k : 2 * k + 2]), ("received from", receives[2 * k : 2 * k + 2])):
                peers = sorted(int(c["peer"]) for c in pair)
                if world > 2 and peers != sorted(ends):
                    return (
                        f"{what}: rank {r}, step {k}: expected it {kind} ranks {sorted(ends)}, it {kind} {peers}: FAIL"
                    )
            empty = [c for c in sends[2 * k : 2 * k + 2] if not int(c["bytes"])]
            if empty:
                return f"{what}: rank {r}, step {k}: an empty message to rank {empty[0]['peer']}: FAIL"
    return f"{what}: PASS"


def link_lines(case: str, ranks: list[dict], world: int, numel: int) -> list[str]:
    """Bytes each rank sent in all, and on each of its two links (to r+1, to r-1), against two_way_budgets."""
    most, per_link = (8 * b for b in two_way_budgets(world, numel))
    sent = [probe.total_bytes(res["calls"], "send") for res in ranks]
    what = f"{case}bytes each rank sent, at most {most:,} (the one-way ring's busiest rank)"
    r = max(range(world), key=lambda q: sent[q])
    lines = [
        f"{what}: rank {r}: expected at most {most:,}, measured {sent[r]:,}: FAIL"
        if sent[r] > most
        else f"{what}: PASS"
    ]
    what = f"{case}bytes on each link in each direction, at most {per_link:,} (half the one-way ring's, rounded)"
    lines.append(f"{what}: PASS")
    for r, res in enumerate(ranks):
        for peer in sorted({(r + 1) % world, (r - 1) % world}):
            links = 2 if world == 2 else 1  # on 2 ranks both of a rank's links lead to the same rank
            on = sum(int(c["bytes"]) for c in _sends(res["calls"]) if int(c["peer"]) == peer)
            if on > links * per_link:
                lines[-1] = (
                    f"{what}: rank {r} to rank {peer}: expected at most {links * per_link:,}, measured {on:,}: FAIL"
                )
                return lines
    return lines


def together_line(case: str, ranks: list[dict]) -> str:
    """At every step k, the rank's k-th pair of sends and pair of receives (one each way) all issued before any was
    waited for. (Pairs in the order of posting: on 2 ranks both directions have the same peer.)"""
    what = f"{case}at every step both directions in flight together"
    for r, res in enumerate(ranks):
        events = res.get("events", [])
        if len(events) != sum(c["op"] in probe.P2P for c in res["calls"]):
            return f"{what}: rank {r} sent or received without parlab.core.comm (its transfers cannot be seen): FAIL"
        sends = [e for e in events if e[0] == "send"]
        recvs = [e for e in events if e[0] == "recv"]
        for k in range(min(len(sends), len(recvs)) // 2):
            step = sends[2 * k : 2 * k + 2] + recvs[2 * k : 2 * k + 2]
            issued, waited = max(e[2] for e in step), min(e[3] if e[3] >= 0 else float("inf") for e in step)
            if issued >= waited:
                return (
                    f"{what}: rank {r}, step {k}: expected its four transfers issued before any is waited for, "
                    f"found one waited for before the last was issued: FAIL"
                )
    return f"{what}: PASS"


def judge_bidirectional(data) -> list[str]:
    lines = []
    for world, numel in BIDIRECTIONAL_CASES:
        ranks = data["runs"][f"{world},{numel}"]
        case = f"P={world}, N={numel}: "
        lines += _whole_lines(case, ranks, world, numel)
        lines.append(steps_line(case, ranks, world))
        lines += link_lines(case, ranks, world, numel)
        lines += [together_line(case, ranks), guard_line(case, ranks)]
    return lines


# ------------------------------------------------------------------------- 3 · an all-reduce across nodes, designed


def collect_hierarchical(hierarchical_all_reduce) -> dict:
    runs = {}
    for name, (nodes, numel) in NODE_LAYOUTS.items():
        world = sum(len(node) for node in nodes)
        runs[name] = list(parlab.launch(_run_whole, world, hierarchical_all_reduce, numel, nodes, **LAUNCH))
    return {"runs": runs}


def node_of(nodes: list[list[int]]) -> dict[int, int]:
    return {q: g for g, node in enumerate(nodes) for q in node}


def node_traffic(nodes: list[list[int]], calls: list[list[dict]]) -> dict[str, list[int]]:
    """Per rank: bytes sent to and received from ranks of other nodes, and bytes sent to ranks of its own node."""
    where = node_of(nodes)
    out = {"sent across": [], "received across": [], "sent inside": []}
    for r, rank_calls in enumerate(calls):
        sends, receives = _sends(rank_calls), _receives(rank_calls)
        out["sent across"].append(sum(int(c["bytes"]) for c in sends if where.get(int(c["peer"]), -1) != where[r]))
        out["received across"].append(
            sum(int(c["bytes"]) for c in receives if where.get(int(c["peer"]), -1) != where[r])
        )
        out["sent inside"].append(sum(int(c["bytes"]) for c in sends if where.get(int(c["peer"]), -1) == where[r]))
    return out


def least_between_nodes(nodes: list[list[int]], numel: int) -> int:
    """The fewest elements any all-reduce sends between nodes, all nodes together: 2(G-1) N. Each element's G node
    sums must meet: one node can hold the total only after G-1 transfers into it (each merges at most one more
    node's share), and each of the other G-1 nodes needs at least one transfer after that (one-way gossip)."""
    return 2 * (len(nodes) - 1) * numel


def least_busiest_port(nodes: list[list[int]], numel: int) -> int:
    """The fewest elements the busiest rank must send to (or receive from) other nodes, in any all-reduce: a lower
    bound, proved here for any layout, and met on this lab's layouts (the solution reaches it).

    Every node must send each element's node sum out at least once (else no other node can hold the total) and
    receive at least once: N elements out of node g, over its own L_g ports, so one of its ranks sends (and
    receives) at least ceil(N / L_g), for every g: ceil(N / min L_g). And all nodes together send at least
    2(G-1) N (least_between_nodes) over the P ports of all ranks: one of them carries at least ceil(2(G-1) N / P).
    On two nodes the first is the larger; on equal nodes of L the second, 2(G-1)N / (G L). On nodes of different
    sizes either may be (nodes of 3, 3 and 2, N=48: both are 24, which an even split of the work misses)."""
    sizes = [len(node) for node in nodes]
    return max(math.ceil(numel / min(sizes)), math.ceil(2 * (len(nodes) - 1) * numel / sum(sizes)))


def inside_cap(node: list[int], numel: int) -> int:
    """The most a rank may send inside its node: what a ring all-reduce of the node would, 2(L-1) ceil(N/L)."""
    L = len(node)
    return 2 * (L - 1) * math.ceil(numel / L)


def judge_hierarchical(data) -> list[str]:
    lines = []
    for name, (nodes, numel) in NODE_LAYOUTS.items():
        ranks, world = data["runs"][name], sum(len(node) for node in nodes)
        case = f"nodes {nodes}, N={numel}: "
        traffic = node_traffic(nodes, [res["calls"] for res in ranks])
        lines += _whole_lines(case, ranks, world, numel)
        least = 8 * least_between_nodes(nodes, numel)
        between = sum(traffic["sent across"])
        what = "bytes sent between nodes, all nodes together"
        lines.append(
            f"{case}{what}: measured {between:,} = the least possible {least:,}: PASS"
            if between == least
            else f"{case}{what}: measured {between:,}, the least possible is {least:,}: FAIL"
        )
        port = 8 * least_busiest_port(nodes, numel)
        busiest = max(range(world), key=lambda q: max(traffic["sent across"][q], traffic["received across"][q]))
        most = max(traffic["sent across"][busiest], traffic["received across"][busiest])
        what = "the busiest network port (the most a rank sends to or receives from other nodes)"
        lines.append(
            f"{case}{what}: measured {most:,} = the least possible {port:,}: PASS"
            if most == port
            else f"{case}{what}: rank {busiest} sent {traffic['sent across'][busiest]:,} and received "
            f"{traffic['received across'][busiest]:,}, the least possible for the busiest is {port:,}: FAIL"
        )
        where = node_of(nodes)
        caps = [8 * inside_cap(nodes[where[r]], numel) for r in range(world)]
        over = [r for r in range(world) if traffic["sent inside"][r] > caps[r]]
        what = "inside each node, no rank sends more than a ring all-reduce of the node would"
        lines.append(
            f"{case}{what}: PASS"
            if not over
            else f"{case}{what}: rank {over[0]} sent {traffic['sent inside'][over[0]]:,} bytes inside node "
            f"{where[over[0]]}, at most {caps[over[0]]:,}: FAIL"
        )
        lines.append(guard_line(case, ranks))
    return lines


# ------------------------------------------------------------ the prediction: what a flat ring sends between nodes


def buckets(world: int = 8) -> list[int]:
    """Elements each rank owns in the prediction's pieces: B_q."""
    return [sum(n for n, o in zip(CROSS_SIZES, CROSS_OWNER, strict=True) if o == q) for q in range(world)]


def flat_ring_cross(ring: list[int], nodes: list[list[int]] = CROSS_NODES) -> int:
    """Bytes sent between nodes, all nodes together, in a flat ring all-reduce of the prediction's pieces over
    `ring`, float64: part 1's reduce-scatter (each piece summed on its owner), then the all-gather that passes the
    finished pieces on round the same ring. A rank's messages cross only when the next rank of the ring is on
    another node; over the two phases rank a, sending to b, sends every piece once in each phase but its own in the
    reduce-scatter (it ends there) and b's in the all-gather (it ends there): 2S - B_a - B_b."""
    P, where, owned = len(ring), node_of(nodes), buckets(len(ring))
    total = sum(CROSS_SIZES)
    hops = [(a, ring[(m + 1) % P]) for m, a in enumerate(ring)]
    return sum(8 * (2 * total - owned[a] - owned[b]) for a, b in hops if where[a] != where[b])


@functools.cache
def fewest_cross(nodes: tuple[tuple[int, ...], ...] = tuple(map(tuple, CROSS_NODES))) -> int:
    """The least flat_ring_cross over every order of the ring (rank 0 first: a ring has no start), searched."""
    P = sum(len(node) for node in nodes)
    return min(flat_ring_cross([0, *rest], [list(n) for n in nodes]) for rest in itertools.permutations(range(1, P)))


def cross_node_theory() -> dict[str, int]:
    """The number the prediction asks for."""
    return {"fewest": fewest_cross()}


THEORY = {"cross_node_bytes": cross_node_theory}


def _plain(value):
    """A prediction as plain data for the grader: a float if it is a number, else its repr (which FAILs)."""
    try:
        return float(value.item() if hasattr(value, "item") else value) if not isinstance(value, bool) else repr(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def _run_cross(phase, rings: dict[str, list[int]]) -> dict[str, int]:
    """Rank side: the student's reduce-scatter of the prediction's pieces on each ring in turn; bytes this rank sent
    to other nodes on each."""
    where, r, out = node_of(CROSS_NODES), dist.get_rank(), {}
    for key, ring in rings.items():
        P = len(ring)
        case = {"ring": ring, "sizes": CROSS_SIZES, "owner": CROSS_OWNER, "touched": [[1] * len(CROSS_SIZES)] * P}
        calls = _run_reduce_scatter(phase, case)["calls"]
        out[key] = sum(int(c["bytes"]) for c in _sends(calls) if where.get(int(c["peer"]), -1) != where[r])
    return out


def _ring(value, world: int) -> list[int] | None:
    """The student's ring as a list of ints, or None if it is not every rank 0..world-1 once."""
    try:
        ring = [int(q) for q in value]
    except (TypeError, ValueError):
        return None
    return ring if sorted(ring) == list(range(world)) else None


def collect_cross_node_bytes(ring, fewest, reduce_scatter_phase) -> dict:
    """The prediction as a number, the student's ring, and (shown, not scored) what the student's own
    reduce-scatter sent between the nodes on their ring."""
    world = sum(len(node) for node in CROSS_NODES)
    data = {"predicted": {"fewest": _plain(fewest)}, "measured": {}, "note": ""}
    data["ring"] = _ring(ring, world) if not isinstance(ring, (str, bytes)) else None
    data["ring_shown"] = repr(ring)[:60]
    if data["ring"]:
        try:
            sent = parlab.launch(_run_cross, world, reduce_scatter_phase, {"yours": data["ring"]}, **LAUNCH)
            data["measured"] = {"yours": sum(s["yours"] for s in sent)}
        except Exception as exc:  # the prediction is graded all the same; only the measurement is missing
            data["note"] = f"your reduce_scatter_phase did not run on 8 ranks ({type(exc).__name__}): nothing measured"
    return data


def judge_cross_node_bytes(data) -> list[str]:
    theory, predicted = cross_node_theory(), data["predicted"]
    label = f"bytes sent between nodes, all nodes together, on your ring (nodes {CROSS_NODES}, float64)"
    lines = prediction_lines(label, predicted.get("fewest"), theory["fewest"], rtol=0)
    right = lines[-1].endswith(": PASS")
    # The ring: judged by what a flat ring on it sends between nodes, against the least over every ring order; no
    # number is printed (the least is the prediction).
    ring, world = data.get("ring"), sum(len(node) for node in CROSS_NODES)
    what = "your ring: the fewest bytes between nodes of any order of the ring"
    if ring is None:
        lines.append(f"{what}: expected every rank 0..{world - 1} once, received {data.get('ring_shown')}: FAIL")
    else:
        least = flat_ring_cross(ring) == theory["fewest"]
        lines.append(f"{what}: PASS" if least else f"{what}: {ring} is not such a ring, more crosses on it: FAIL")
        right = right and least
    measured = data.get("measured") or {}
    if measured and right:  # shown only once the prediction is right: not a number to copy
        lines.append(
            f"measured, your reduce-scatter alone (the first of the two phases) on your ring: "
            f"{measured.get('yours', 0):,} bytes between nodes"
        )
    if data.get("note"):
        lines.append(data["note"])
    return lines


# ---------------------------------------------------------------------- 5 · recursive halving and doubling


def collect_halving_doubling(halving_doubling_all_reduce) -> dict:
    runs = {}
    for world, numel in HALVING_CASES:
        runs[f"{world},{numel}"] = list(parlab.launch(_run_whole, world, halving_doubling_all_reduce, numel, **LAUNCH))
    return {"runs": runs}


def rounds(calls: list[dict]) -> int:
    """How many rounds a rank's messages take, a round being one send and/or one receive with one partner: in the
    order they were posted, a message opens a new round when its partner differs from the round's or the round
    already holds a message of its kind."""
    count, partner, kinds = 0, None, set()
    for c in calls:
        if c["op"] not in probe.P2P:
            continue
        kind = "send" if c["op"] == "send" else "recv"
        if int(c["peer"]) != partner or kind in kinds:
            count, partner, kinds = count + 1, int(c["peer"]), set()
        kinds.add(kind)
    return count


def round_budget(world: int) -> int:
    """The most rounds a rank may take: 2 log2 P on a power of two, 2 floor(log2 P) + 2 otherwise (two more for
    the ranks beyond the largest power of two)."""
    steps = world.bit_length() - 1
    return 2 * steps + (0 if world == 1 << steps else 2)


def halving_bytes(world: int, numel: int) -> list[int] | int:
    """Bytes, float64. On a power of two P that divides N, each rank's exactly: 2(P-1)/P N (it sends all but its
    own share on the way in, and again on the way out). Otherwise the most the busiest rank may send, with P' the
    largest power of two <= P and L = log2 P': N + 2(N - floor(N/P')) + L elements (without the first N where P is
    a power of two).

    Why a fold-in/fold-out design meets it for every P and N (a rank beyond P' hands its x to one inside and gets the
    total back; the P' ranks inside run halving then doubling; each rank inside takes at most one such x): a rank
    beyond P' sends N. A rank inside sends at most N to fold out, plus, if its block after the i-th halving holds k_i
    elements (k_0 = N), N - k_L while halving and k_L + ... + k_1 while doubling (each doubling step sends the block
    it kept). With every block cut into halves that differ by at most one element, k_i <= ceil(N / 2^i) and
    k_L >= floor(N/P'), so k_1 + ... + k_L < N - N/P' + L: the rank sends at most N + 2(N - floor(N/P')) + L
    (tests/test_lab00_halving_budget.py simulates such designs for P <= 32, N <= 300)."""
    inside = 1 << (world.bit_length() - 1)
    if inside == world and numel % world == 0:
        return [8 * 2 * (numel - numel // world)] * world
    return 8 * ((numel if inside != world else 0) + 2 * (numel - numel // inside) + inside.bit_length() - 1)


def rounds_line(case: str, ranks: list[dict], world: int) -> str:
    budget, exact = round_budget(world), world & (world - 1) == 0
    what = f"{case}rounds of messages per rank ({'exactly' if exact else 'at most'} {budget})"
    for r, res in enumerate(ranks):
        n = rounds(res["calls"])
        if n > budget or (exact and n != budget):
            return f"{what}: rank {r}: expected {'' if exact else 'at most '}{budget}, measured {n}: FAIL"
    return f"{what}: PASS"


def busiest_line(case: str, measured: list[int], most: int) -> str:
    what = f"{case}bytes the busiest rank sent (at most {most:,})"
    r = max(range(len(measured)), key=lambda q: measured[q])
    if measured[r] > most:
        return f"{what}: rank {r}: expected at most {most:,}, measured {measured[r]:,}: FAIL"
    return f"{what}: PASS"


def judge_halving_doubling(data) -> list[str]:
    lines = []
    for world, numel in HALVING_CASES:
        ranks = data["runs"][f"{world},{numel}"]
        case = f"P={world}, N={numel}: "
        lines += _whole_lines(case, ranks, world, numel)
        lines.append(rounds_line(case, ranks, world))
        measured, theory = [probe.total_bytes(res["calls"], "send") for res in ranks], halving_bytes(world, numel)
        if isinstance(theory, list):
            lines.append(bytes_line(case, measured, theory))
        else:
            lines.append(busiest_line(case, measured, theory))
        lines.append(guard_line(case, ranks))
    return lines
