"""Lab 00's checks: a ring reduce-scatter, a bidirectional ring all-reduce, a hierarchical (2D) all-reduce on nodes,
a prediction of the bytes that cross between nodes, and recursive halving/doubling, on live ranks (see
parlab/grading/__init__.py for the scheme).

Beyond "every rank holds the right sum", each check verifies from what the ranks handed to torch.distributed
(parlab.core.probe) that the sum was computed by the student's own messages: who sent to whom, in which order,
which partial sums they carried, how many bytes; for the bidirectional ring, from parlab.core.comm's trace, that the
two directions were in flight together. Calls into the library's ring (parlab/schemes/collectives.py, lesson 00's
helpers) or into this module are seen too (parlab/grading/labs/guard.py).

The expected messages are computed here from the inputs alone, by following each piece of data round its ring
(`Piece`: a value and the ranks summed into it), never by running an all-reduce. A FAIL line names the first wrong
item: the rank, its message, what was expected (e.g. "chunk 2 summed over ranks [0, 1]") and what came (which
partial sum it matches, if any).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.check import compare
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a send nobody receives) is diagnosed in ~2 s; 60 s stops the rest
# What the answers must not call: the library's ring and lesson 00's helpers, and this module (its expected messages).
LIBRARY = ("schemes/collectives.py", "lessons/collectives.py", "grading/labs/lab00_ring_allreduce.py")
P, NUMEL = 4, 1000  # the reduce-scatter's first case: 4 ranks, chunks of 250
UNEVEN = (3, 10)  # its second case, and the bidirectional ring's: chunks of 4, 3, 3 elements
BIDIRECTIONAL_CASES = [(4, 1000), UNEVEN]
NODE_LAYOUTS = {  # name: (nodes, N); nodes[g] = the global ranks of node g, its local ranks in that order
    "2 nodes x 2 ranks": ([[0, 1], [2, 3]], 1000),
    "2 nodes x 3 ranks": ([[0, 1, 2], [3, 4, 5]], 1000),
    "3 nodes x 2 ranks, ranks dealt round-robin": ([[0, 3], [1, 4], [2, 5]], 10),
}
PREDICTED_NODES, PREDICTED_NUMEL = [[0, 1, 2, 3], [4, 5, 6, 7]], 1200  # the prediction: 2 nodes x 4 ranks, float64
HALVING_CASES = [(4, 1000), (8, 1000)]  # (P, N): P a power of two

STRUCTURAL = {
    "reduce_scatter": "P=4, N=1000 and P=3, N=10 (chunks of 4, 3, 3): rank r ends with the sum of chunk r; every "
    "rank sends P-1 messages, only to its right neighbour, receives P-1 only from its left, and each message is the "
    "partial sum the ring carries at that step; bytes per rank; no library collective, no call into the library's ring",
    "bidirectional": "P=4 and P=3 with uneven halves: the sum on every rank; 2(P-1) messages to each neighbour, the "
    "first halves of the chunks on the clockwise ring and the second halves on the counter-clockwise one, each the "
    "partial sum or finished half that ring carries at that step; at every step both directions in flight together "
    "(parlab.core.comm's trace: every transfer of the step issued before any was waited for); bytes each way",
    "hierarchical": "three node layouts (2x2, 2x3, and 3x2 with ranks dealt round-robin over the nodes, N=10): the "
    "sum on every rank; each rank's sends and receives in order: L-1 to its node's next rank, 2(G-1) to the same "
    "local rank of the next node, L-1 to its node's next rank; each message the partial sum or finished piece of the "
    "intra-node reduce-scatter, the inter-node ring all-reduce of the rank's chunk and the intra-node all-gather; "
    "bytes each rank sends to other nodes; no library collective or library ring",
    "cross_node_bytes": "the three predicted byte counts (2 nodes x 4 ranks, N=1200 float64: what node 0 sends to "
    "node 1 in part 1's flat ring and in the hierarchical all-reduce, and the most one rank of node 0 sends there) "
    "equal the counts of the messages those algorithms must send (exactly); the student's own hierarchical "
    "all-reduce measured beside them (shown, not scored)",
    "halving_doubling": "log2 P exchanges per phase, each with a single partner (the same rank sends to and "
    "receives from), message sizes halving then doubling, each message the partial sum or finished block that "
    "recursive halving/doubling carries at that step when rank r ends the first phase with chunk r; no library "
    "collective or library code; bytes per rank 2(P-1)/P x N; P=4 and P=8",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def rank_input(rank: int, numel: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What rank `rank` contributes: [numel], drawn from a seed so the parent can redraw it."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)  # host: the seeded draw
    return x.to(dtype)


# ------------------------------------------------------------------------ what each ring must carry, by hand


@dataclass(frozen=True)
class Piece:
    """A piece of data on its way round a ring: its value, which piece of x it is, which ranks are summed in it."""

    value: torch.Tensor
    name: str  # "chunk 2", "half 1 of chunk 2", "piece 0 of chunk 1"
    ranks: frozenset[int]

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.value + other.value, self.name, self.ranks | other.ranks)

    def describe(self, world: int) -> str:
        summed = "all ranks" if len(self.ranks) == world else f"ranks {sorted(self.ranks)}"
        n = self.value.numel()
        return f"{self.name} summed over {summed} ({n} value{'' if n == 1 else 's'})"


@dataclass
class Traffic:
    """What an algorithm makes each rank do, in order: sends[r] = [(to rank, the Piece it must carry)], and
    receives[r] = [from rank]."""

    world: int

    def __post_init__(self):
        self.sends: dict[int, list[tuple[int, Piece]]] = {r: [] for r in range(self.world)}
        self.receives: dict[int, list[int]] = {r: [] for r in range(self.world)}

    def message(self, src: int, dst: int, piece: Piece) -> None:
        self.sends[src].append((dst, piece))
        self.receives[dst].append(src)

    def payload(self) -> list[int]:
        """Bytes each rank hands to isend."""
        return [sum(p.value.numel() * p.value.element_size() for _, p in self.sends[r]) for r in range(self.world)]


def ring_reduce_scatter(ring: list[int], held: dict[int, list[Piece]], traffic: Traffic) -> None:
    """Follow a ring reduce-scatter over the ranks `ring` (each sends to the next in the list), in place.

    held[rank][i]: that rank's copy of piece i, which must end finished on ring[i]. At step s the member at position
    m sends piece (m-1-s) mod M (the one that reaches its owner after the hops left) and adds what arrives."""
    M = len(ring)
    for s in range(M - 1):
        outgoing = {m: held[ring[m]][(m - 1 - s) % M] for m in range(M)}
        for m in range(M):
            traffic.message(ring[m], ring[(m + 1) % M], outgoing[m])
        for m in range(M):
            i = (m - 2 - s) % M
            held[ring[m]][i] = held[ring[m]][i] + outgoing[(m - 1) % M]


def ring_all_gather(ring: list[int], held: dict[int, list[Piece | None]], traffic: Traffic) -> None:
    """Follow a ring all-gather: ring[m] starts with piece m finished and passes the finished pieces on, in place."""
    M = len(ring)
    for s in range(M - 1):
        outgoing = {m: held[ring[m]][(m - s) % M] for m in range(M)}
        for m in range(M):
            traffic.message(ring[m], ring[(m + 1) % M], outgoing[m])
        for m in range(M):
            held[ring[m]][(m - 1 - s) % M] = outgoing[(m - 1) % M]


def _inputs(world: int, numel: int) -> list[torch.Tensor]:
    return [rank_input(q, numel) for q in range(world)]


def _pieces(tensors, name: str, ranks: frozenset[int]) -> list[Piece]:
    return [Piece(t, name.format(i), ranks) for i, t in enumerate(tensors)]


def reduce_scatter_traffic(world: int, numel: int) -> Traffic:
    """Part 1: a ring reduce-scatter over ranks 0..P-1 that leaves chunk r on rank r."""
    traffic = Traffic(world)
    held = {q: _pieces(x.tensor_split(world), "chunk {}", frozenset([q])) for q, x in enumerate(_inputs(world, numel))}
    ring_reduce_scatter(list(range(world)), held, traffic)
    return traffic


def bidirectional_traffic(world: int, numel: int) -> list[Traffic]:
    """Part 2: [the clockwise ring's traffic, the counter-clockwise ring's]. Chunk c's first half goes round the
    ring 0 -> 1 -> ... and its second half round P-1 -> P-2 -> ...; both finish on rank c, then travel on."""
    halves = [[c.tensor_split(2) for c in x.tensor_split(world)] for x in _inputs(world, numel)]
    out = []
    for h, ring in ((0, list(range(world))), (1, list(reversed(range(world))))):
        traffic = Traffic(world)
        # Piece i of a rank's list must end on position i of the ring, rank ring[i]: it is chunk ring[i]'s half.
        held = {q: [Piece(halves[q][c][h], f"half {h} of chunk {c}", frozenset([q])) for c in ring] for q in ring}
        ring_reduce_scatter(ring, held, traffic)
        ring_all_gather(ring, held, traffic)
        out.append(traffic)
    return out


def hierarchical_traffic(nodes: list[list[int]], numel: int) -> Traffic:
    """Part 3, in each rank's order: the reduce-scatter of its node (local rank l ends with chunk l of L), the ring
    all-reduce of chunk l over the nodes (piece g of G finished on node g, then gathered), the all-gather of its
    node."""
    G, L = len(nodes), len(nodes[0])
    world = G * L
    traffic = Traffic(world)
    held = {q: _pieces(x.tensor_split(L), "chunk {}", frozenset([q])) for q, x in enumerate(_inputs(world, numel))}
    for node in nodes:
        ring_reduce_scatter(node, held, traffic)
    for l in range(L):  # noqa: E741 (l: the local rank, as in the text)
        across = [node[l] for node in nodes]  # local rank l of every node, in node order
        pieces = {
            q: _pieces(held[q][l].value.tensor_split(G), f"piece {{}} of chunk {l}", held[q][l].ranks) for q in across
        }
        ring_reduce_scatter(across, pieces, traffic)
        ring_all_gather(across, pieces, traffic)
        for q in across:
            held[q][l] = Piece(torch.cat([p.value for p in pieces[q]]), f"chunk {l}", frozenset(range(world)))
    for node in nodes:
        finished = {q: [held[q][i] if i == node.index(q) else None for i in range(L)] for q in node}
        ring_all_gather(node, finished, traffic)
    return traffic


def halving_doubling_partners(r: int, world: int) -> list[int]:
    """Rank r's partner at each step, both phases."""
    distances = []
    d = world // 2
    while d >= 1:
        distances.append(d)
        d //= 2
    return [r ^ d for d in distances] + [r ^ d for d in reversed(distances)]


def halving_doubling_traffic(world: int, numel: int) -> Traffic:
    """Part 5: what each rank must send at each step, from the inputs alone.

    Before the step at distance d of the first phase, rank r's data sums the ranks q that differ from r only in the
    bits below 2d; it hands its partner the block of d chunks the partner goes on with. In the second phase it
    hands its partner the finished block of d chunks it holds."""
    inputs = [x.tensor_split(world) for x in _inputs(world, numel)]
    total = sum(_inputs(world, numel)).tensor_split(world)
    traffic = Traffic(world)
    for r in range(world):
        partners = halving_doubling_partners(r, world)
        for step, p in enumerate(partners):
            d = r ^ p
            if step < len(partners) // 2:
                first = p & ~(d - 1)  # the partner's block of chunks
                group = frozenset(q for q in range(world) if (q ^ r) & (2 * d - 1) == 0)
                value = torch.cat([sum(inputs[q][c] for q in group) for c in range(first, first + d)])
            else:
                first, group = r & ~(d - 1), frozenset(range(world))  # this rank's finished block
                value = torch.cat([total[c] for c in range(first, first + d)])
            name = f"chunk {first}" if d == 1 else f"chunks {first}..{first + d - 1}"
            traffic.message(r, p, Piece(value, name, group))
    for r in range(world):  # each rank receives from its partner of each step, in that order
        traffic.receives[r] = halving_doubling_partners(r, world)
    return traffic


# --------------------------------------------------------------------------------------------- the verdicts


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


def peers_line(case: str, ranks: list[dict], traffic: Traffic, what: str) -> str:
    """Each rank sent to the expected ranks and received from the expected ranks, in order; a FAIL names the first
    rank and message that differ, with what was expected and what was found."""
    for r in range(traffic.world):
        for kind, got, want in (
            ("send", [int(c["peer"]) for c in _sends(ranks[r]["calls"])], [to for to, _ in traffic.sends[r]]),
            ("receive", [int(c["peer"]) for c in _receives(ranks[r]["calls"])], traffic.receives[r]),
        ):
            if got == want:
                continue
            i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            way = "to" if kind == "send" else "from"
            if i < min(len(got), len(want)):
                expected, found = f"expected {way} rank {want[i]}", f"found {way} rank {got[i]}"
                return f"{case}{what}: rank {r}, {kind} {i}: {expected}, {found}: FAIL"
            return f"{case}{what}: rank {r}: expected {len(want)} {kind}s, found {len(got)} {got[:8]}: FAIL"
    return f"{case}{what}: PASS"


def _identify(value: torch.Tensor, world: int, units: dict[str, list[torch.Tensor]]) -> str:
    """What a wrong message holds, if it is some piece of x summed over some ranks (units: name -> each rank's)."""
    for name, per_rank in units.items():
        if per_rank[0].numel() != value.numel():
            continue
        for size in range(1, world + 1):
            for subset in itertools.combinations(range(world), size):
                if torch.allclose(value, sum(per_rank[q] for q in subset), rtol=0, atol=1e-10):
                    summed = "all ranks" if size == world else f"ranks {list(subset)}"
                    return f"{name} summed over {summed}"
    return "no partial sum of any piece"


def messages_line(case: str, ranks: list[dict], traffic: Traffic, what: str, units: dict | None = None) -> str:
    """Each message a rank sent, in order, is the expected piece; a FAIL names the first wrong one: its rank and
    number, the piece expected, and what came (the piece it matches, when `units` are given)."""
    world, got_all, want_all = traffic.world, [], []
    for r in range(world):
        got = [c.get("data") for c in _sends(ranks[r]["calls"])]
        want = [piece for _, piece in traffic.sends[r]]
        for i, (message, piece) in enumerate(zip(got, want, strict=False)):
            if message is not None and message.shape == piece.value.shape:
                if torch.allclose(message.to(torch.float64), piece.value, rtol=0, atol=1e-10):
                    continue
            if message is None:
                came = "nothing readable"
            elif message.shape != piece.value.shape:
                came = f"{message.numel()} values"
            elif units:
                came = _identify(message.to(torch.float64), world, units)
            else:
                came = f"values off by up to {(message.to(torch.float64) - piece.value).abs().max().item():.2g}"
            return f"{case}{what}: rank {r}, send {i}: expected {piece.describe(world)}, received {came}: FAIL"
        if len(got) != len(want):
            return f"{case}{what}: rank {r}: expected {len(want)} messages, it sent {len(got)}: FAIL"
        got_all += got
        want_all += [piece.value for piece in want]
    return compare(f"{case}{what}", got_all, want_all, against="the algorithm's").line


def bytes_line(case: str, measured: list[int], theory: list[int], what: str = "bytes each rank sent") -> str:
    for r, (m, t) in enumerate(zip(measured, theory, strict=True)):
        if m != t:
            return f"{case}{what}: rank {r}: measured {m} != theory {t}: FAIL"
    return f"{case}{what}: measured {measured} = theory {theory}: PASS"


def sum_line(case: str, what: str, got: list, expected: list[torch.Tensor], names: list[str]) -> str:
    """The results against the single-device sum; a FAIL names the first wrong rank: expected and received."""
    for name, a, b in zip(names, got, expected, strict=True):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            came = f"shape {list(a.shape)}" if isinstance(a, torch.Tensor) else repr(a)[:40]
            return f"{case}{what}: {name}: expected {b.numel()} values, received {came}: FAIL"
        if not torch.allclose(a.to(torch.float64), b, rtol=0, atol=1e-10):
            i = int((a.to(torch.float64) - b).abs().argmax())
            return f"{case}{what}: {name}: element {i}: expected {b[i].item():.6g}, received {a[i].item():.6g}: FAIL"
    return compare(f"{case}{what}", got, expected).line


def _record(answer, *args) -> dict:
    """Rank side: run the answer with every process-group call recorded and library calls watched; the traced
    sends and receives it issued, [kind, peer, issued at, waited for at (-1: never)], for the timing checks."""
    since = time.perf_counter()
    with probe.recording() as calls, library_calls(LIBRARY) as called:
        out = answer(*args)
    events = [
        [e.kind, -1 if e.peer is None else int(e.peer), e.start, -1.0 if e.end is None else e.end]
        for e in comm.trace_events()
        if e.kind in ("send", "recv") and e.start >= since
    ]
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
    results = [res["out"] for res in ranks]
    return [
        collective_line(case, ranks),
        sum_line(case, "the all-reduce on every rank", results, [total] * world, names),
    ]


def _units(world: int, numel: int, parts: int, name: str) -> dict[str, list[torch.Tensor]]:
    """Every chunk's `parts` pieces, per rank, for naming what a wrong message holds."""
    split = [[c.tensor_split(parts) for c in x.tensor_split(world)] for x in _inputs(world, numel)]
    return {name.format(c=c, h=h): [split[q][c][h] for q in range(world)] for c in range(world) for h in range(parts)}


# ------------------------------------------------------------------------------------ 1 · the reduce-scatter


def _run_reduce_scatter(phase, numel: int) -> dict:
    world, r = dist.get_world_size(), dist.get_rank()
    chunks = [c.clone() for c in rank_input(r, numel).to(parlab.device()).tensor_split(world)]
    result = _record(phase, chunks)
    return {"chunks": [c.cpu() for c in chunks], "calls": result["calls"], "library": result["library"]}


def collect_reduce_scatter(reduce_scatter_phase) -> dict:
    world, numel = UNEVEN
    return {
        "ranks": list(parlab.launch(_run_reduce_scatter, P, reduce_scatter_phase, NUMEL, **LAUNCH)),
        "uneven": list(parlab.launch(_run_reduce_scatter, world, reduce_scatter_phase, numel, **LAUNCH)),
    }


def judge_reduce_scatter(data) -> list[str]:
    lines = []
    for (world, numel), ranks in (((P, NUMEL), data["ranks"]), (UNEVEN, data.get("uneven"))):
        case = f"P={world}, N={numel}: "
        if ranks is None:  # the grader always collects it; a hand-made dict may lack it
            lines.append(f"{case}the ranks' results: missing: FAIL")
            continue
        total = sum(_inputs(world, numel)).tensor_split(world)  # the single-device reference, chunked
        traffic = reduce_scatter_traffic(world, numel)
        got = [res["chunks"][r] if len(res["chunks"]) > r else None for r, res in enumerate(ranks)]
        lines += [
            collective_line(case, ranks),
            sum_line(case, "rank r holds the sum of chunk r", got, list(total), [f"rank {r}" for r in range(world)]),
            peers_line(case, ranks, traffic, "P-1 sends to the right neighbour, P-1 receives from the left"),
            messages_line(
                case,
                ranks,
                traffic,
                "each message sent is the partial sum the ring carries at that step",
                _units(world, numel, 1, "chunk {c}"),
            ),
            bytes_line(case, [probe.total_bytes(res["calls"], "send") for res in ranks], traffic.payload()),
            guard_line(case, ranks),
        ]
    return lines


# ------------------------------------------------------------------------------- 2 · the bidirectional ring


def collect_bidirectional(bidirectional_all_reduce) -> dict:
    runs = {}
    for world, numel in BIDIRECTIONAL_CASES:
        runs[f"{world},{numel}"] = list(parlab.launch(_run_whole, world, bidirectional_all_reduce, numel, **LAUNCH))
    return {"runs": runs}


def _one_way(ranks: list[dict], world: int, hop: int) -> list[dict]:
    """Each rank's calls of one direction: its sends to rank r+hop and its receives from rank r-hop."""
    out = []
    for r, res in enumerate(ranks):
        to, frm = (r + hop) % world, (r - hop) % world
        sends = [c for c in _sends(res["calls"]) if c["peer"] == to]
        out.append({"calls": sends + [c for c in _receives(res["calls"]) if c["peer"] == frm]})
    return out


def together_line(case: str, ranks: list[dict], world: int) -> str:
    """At every step k, the k-th transfer each way (two sends, two receives) all issued before any was waited for."""
    what = f"{case}at every step both directions in flight together"
    for r, res in enumerate(ranks):
        events = res.get("events", [])
        if len(events) != sum(c["op"] in probe.P2P for c in res["calls"]):
            return f"{what}: rank {r} sent or received without parlab.core.comm (its transfers cannot be seen): FAIL"
        right, left = (r + 1) % world, (r - 1) % world
        streams = [
            [e for e in events if e[0] == kind and e[1] == peer]
            for kind, peer in (("send", right), ("recv", left), ("send", left), ("recv", right))
        ]
        for k in range(min(len(s) for s in streams)):
            step = [s[k] for s in streams]
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
        units = _units(world, numel, 2, "half {h} of chunk {c}")
        clockwise, counter = bidirectional_traffic(world, numel)
        for hop, traffic, ring in ((1, clockwise, "clockwise ring"), (-1, counter, "counter-clockwise ring")):
            side = _one_way(ranks, world, hop)
            what = f"{ring} (halves {'0 to r+1' if hop == 1 else '1 to r-1'})"
            lines += [
                peers_line(case, side, traffic, f"{what}: 2(P-1) sends, 2(P-1) receives"),
                messages_line(case, side, traffic, f"{what}: each message what that ring carries", units),
                bytes_line(
                    case, [probe.total_bytes(res["calls"], "send") for res in side], traffic.payload(), f"{what}: bytes"
                ),
            ]
        lines += [together_line(case, ranks, world), guard_line(case, ranks)]
    return lines


# ------------------------------------------------------------------------------ 3 · the hierarchical all-reduce


def collect_hierarchical(hierarchical_all_reduce) -> dict:
    runs = {}
    for name, (nodes, numel) in NODE_LAYOUTS.items():
        world = sum(len(node) for node in nodes)
        runs[name] = list(parlab.launch(_run_whole, world, hierarchical_all_reduce, numel, nodes, **LAUNCH))
    return {"runs": runs}


def node_of(nodes: list[list[int]]) -> dict[int, int]:
    return {q: g for g, node in enumerate(nodes) for q in node}


def cross_node_bytes(nodes: list[list[int]], traffic_or_calls) -> list[int]:
    """Bytes each rank sends to ranks of other nodes: from a Traffic, or from each rank's recorded calls."""
    where = node_of(nodes)
    if isinstance(traffic_or_calls, Traffic):
        t = traffic_or_calls
        return [sum(p.value.numel() * 8 for to, p in t.sends[r] if where[to] != where[r]) for r in range(t.world)]
    return [
        sum(int(c["bytes"]) for c in _sends(calls) if where.get(int(c["peer"]), -1) != where[r])
        for r, calls in enumerate(traffic_or_calls)
    ]


def judge_hierarchical(data) -> list[str]:
    lines = []
    for name, (nodes, numel) in NODE_LAYOUTS.items():
        ranks, world = data["runs"][name], sum(len(node) for node in nodes)
        case = f"{name}, N={numel}: "
        traffic = hierarchical_traffic(nodes, numel)
        G, L = len(nodes), len(nodes[0])
        units = _units(world, numel, 1, "chunk {c} (of P)")
        units.update(_units_of_node_chunks(world, numel, L, G))
        lines += _whole_lines(case, ranks, world, numel)
        lines += [
            peers_line(case, ranks, traffic, "each rank's sends and receives, in order (node, across, node)"),
            messages_line(case, ranks, traffic, "each message the piece that phase carries at that step", units),
            bytes_line(
                case,
                cross_node_bytes(nodes, [res["calls"] for res in ranks]),
                cross_node_bytes(nodes, traffic),
                "bytes each rank sent to other nodes",
            ),
            guard_line(case, ranks),
        ]
    return lines


def _units_of_node_chunks(world: int, numel: int, L: int, G: int) -> dict[str, list[torch.Tensor]]:
    """The chunks of L and their pieces of G, per rank, for naming what a wrong message holds."""
    chunks = [x.tensor_split(L) for x in _inputs(world, numel)]
    units = {f"chunk {l}": [chunks[q][l] for q in range(world)] for l in range(L)}  # noqa: E741
    for l in range(L):  # noqa: E741
        for g in range(G):
            units[f"piece {g} of chunk {l}"] = [chunks[q][l].tensor_split(G)[g] for q in range(world)]
    return units


# ------------------------------------------------------------------ the prediction: bytes that cross between nodes


def flat_ring_traffic(world: int, numel: int) -> Traffic:
    """Part 1's ring over ranks 0..P-1, both phases: the reduce-scatter that leaves chunk r on rank r, then the
    all-gather from there."""
    traffic = reduce_scatter_traffic(world, numel)
    total = sum(_inputs(world, numel)).tensor_split(world)
    finished = {q: [Piece(total[q], f"chunk {q}", frozenset(range(world))) if i == q else None for i in range(world)]
                for q in range(world)}  # fmt: skip
    ring_all_gather(list(range(world)), finished, traffic)
    return traffic


def cross_node_theory() -> dict[str, int]:
    """The three numbers the prediction asks for, from the messages the two algorithms must send."""
    nodes, numel = PREDICTED_NODES, PREDICTED_NUMEL
    world, where = sum(len(node) for node in nodes), node_of(nodes)
    flat = cross_node_bytes(nodes, flat_ring_traffic(world, numel))
    hier = cross_node_bytes(nodes, hierarchical_traffic(nodes, numel))
    node0 = [r for r in range(world) if where[r] == 0]
    return {
        "flat_cross": sum(flat[r] for r in node0),
        "hier_cross": sum(hier[r] for r in node0),
        "hier_busiest": max(hier[r] for r in node0),
    }


THEORY = {"cross_node_bytes": cross_node_theory}


def _plain(value):
    """A prediction as plain data for the grader: a float if it is a number, else its repr (which FAILs)."""
    try:
        return float(value.item() if hasattr(value, "item") else value) if not isinstance(value, bool) else repr(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_cross_node_bytes(flat_cross, hier_cross, hier_busiest, hierarchical_all_reduce) -> dict:
    """The predictions as numbers, and (shown, not scored) what the student's own hierarchical all-reduce sent."""
    predicted = {"flat_cross": flat_cross, "hier_cross": hier_cross, "hier_busiest": hier_busiest}
    data = {"predicted": {k: _plain(v) for k, v in predicted.items()}, "measured": [], "note": ""}
    world = sum(len(node) for node in PREDICTED_NODES)
    try:
        ranks = parlab.launch(_run_whole, world, hierarchical_all_reduce, PREDICTED_NUMEL, PREDICTED_NODES, **LAUNCH)
        data["measured"] = cross_node_bytes(PREDICTED_NODES, [res["calls"] for res in ranks])
    except Exception as exc:  # the prediction is graded all the same; only the measurement is missing
        data["note"] = f"your hierarchical_all_reduce did not run on 8 ranks ({type(exc).__name__}): nothing measured"
    return data


LABELS = {
    "flat_cross": "bytes node 0 sends to node 1, flat ring",
    "hier_cross": "bytes node 0 sends to node 1, hierarchical",
    "hier_busiest": "the most one rank of node 0 sends to node 1, hierarchical",
}


def judge_cross_node_bytes(data) -> list[str]:
    theory, predicted, lines = cross_node_theory(), data["predicted"], []
    for key, label in LABELS.items():
        lines += prediction_lines(
            f"{label} (2 nodes x 4, N={PREDICTED_NUMEL} float64)", predicted.get(key), theory[key], rtol=0
        )
    measured = data.get("measured") or []
    if measured:
        node0 = PREDICTED_NODES[0]
        lines.append(
            f"measured in your hierarchical all-reduce: node 0 sent {sum(measured[r] for r in node0):,} bytes to "
            f"node 1, its busiest rank {max(measured[r] for r in node0):,}"
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


def judge_halving_doubling(data) -> list[str]:
    lines = []
    for world, numel in HALVING_CASES:
        ranks = data["runs"][f"{world},{numel}"]
        case = f"P={world}, N={numel}: "
        traffic = halving_doubling_traffic(world, numel)
        lines += _whole_lines(case, ranks, world, numel)
        steps = 2 * (world.bit_length() - 1)
        lines += [
            peers_line(case, ranks, traffic, f"every rank: {steps} exchanges, one partner each"),
            messages_line(case, ranks, traffic, "the messages every rank sent"),
            bytes_line(case, [probe.total_bytes(res["calls"], "send") for res in ranks], traffic.payload()),
            guard_line(case, ranks),
        ]
    return lines
