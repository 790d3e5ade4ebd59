"""Lab 00's checks: the student's ring all-reduce and recursive halving/doubling all-reduce, on live ranks (see
parlab/grading/__init__.py for the scheme).

Beyond "every rank holds the right sum", each check verifies from what the ranks handed to torch.distributed
(parlab.core.probe) that the sum was computed by the student's own messages: who sent to whom, how many
messages, which partial sums they carried, how many bytes.

The expected messages are computed here from the inputs alone (which ranks' data a message must have summed,
over which chunks), never by running an all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.check import check_equal, compare
from parlab.grading.labs import prediction_lines, run_check

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a send nobody receives) stops after 60 s and names the ranks
P, NUMEL = 4, 1000  # the phases' checks; the whole ring also runs on RING_CASES
RING_CASES = [(3, 10), (4, 1000)]  # (P, N): chunks of 4, 3, 3 elements; of 250
HALVING_CASES = [(4, 1000), (8, 1000)]  # (P, N): P a power of two
PREDICTED = (4, 10, torch.float32)  # the prediction: P, N and the dtype of the ring it is about
PREDICTED_RANKS = (0, 2)

STRUCTURAL = {
    "reduce_scatter": "rank r ends with the sum of chunk r; every rank sends P-1 messages, only to its right "
    "neighbour, receives P-1 only from its left, calls no library collective, and each message is the partial "
    "sum the ring carries at that step",
    "all_gather": "the same ring pattern; each message is a finished chunk, and every chunk arrives",
    "ring_all_reduce": "both phases together: 2(P-1) messages per rank on the ring, the partial sums then the "
    "finished chunks, no library collective, bytes per rank as the ring's; P=3 with uneven chunks",
    "ring_traffic": "the predicted bytes ranks 0 and 2 hand to isend (P=4, N=10 float32) against the theory "
    "computed from the chunk sizes (within 5%); the student's own ring measured beside it (shown, not scored)",
    "halving_doubling": "log2 P exchanges per phase, each with a single partner (the same rank sends to and "
    "receives from), message sizes halving then doubling, each message the partial sum or finished block that "
    "recursive halving/doubling carries at that step when rank r ends the first phase with chunk r; no library "
    "collective; bytes per rank 2(P-1)/P x N; P=4 and P=8",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def rank_input(rank: int, numel: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What rank `rank` contributes: [numel], drawn from a seed so the parent can redraw it."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).to(dtype)


def ring_all_reduce(x: torch.Tensor, reduce_scatter_phase, all_gather_phase) -> torch.Tensor:
    """x: [N] on every rank -> the sum over ranks, [N], on every rank: your two phases, one after the other."""
    chunks = [c.clone() for c in x.tensor_split(dist.get_world_size())]  # P chunks; sizes differ by at most 1
    reduce_scatter_phase(chunks)
    all_gather_phase(chunks)
    return torch.cat(chunks)


# ------------------------------------------------------------------------------------- what the ring must send


def _chunks(q: int, world: int, numel: int, dtype=torch.float64) -> list[torch.Tensor]:
    return list(rank_input(q, numel, dtype).tensor_split(world))


def reduce_scatter_messages(r: int, world: int, numel: int, dtype=torch.float64) -> list[torch.Tensor]:
    """What rank r must send at each step of a reduce-scatter that leaves chunk c on rank c."""
    chunks = [_chunks(q, world, numel, dtype) for q in range(world)]
    messages = []
    for s in range(world - 1):
        c = (r - 1 - s) % world  # the chunk that reaches its owner after the remaining hops
        messages.append(sum(chunks[(r - k) % world][c] for k in range(s + 1)))  # ranks r-s .. r added so far
    return messages


def all_gather_messages(r: int, world: int, numel: int, dtype=torch.float64) -> list[torch.Tensor]:
    """What rank r must send at each step of the all-gather that starts from chunk c finished on rank c."""
    total = sum(rank_input(q, numel, dtype) for q in range(world)).tensor_split(world)
    return [total[(r - s) % world] for s in range(world - 1)]


def _peers(calls, ops) -> list[int]:
    return [int(c["peer"]) for c in calls if c["op"] in ops]


def collective_verdict(label: str, calls_per_rank: list) -> str:
    """One verdict: no rank called a library collective (all-reduce & co., seen at the process group)."""
    found = [(r, sorted(set(probe.library_collectives(calls)))) for r, calls in enumerate(calls_per_rank)]
    found = [f"rank {r} called library collective(s) {ops}" for r, ops in found if ops]
    what = f"{label}no library collective on any rank, only isend/irecv"
    return f"{what}: PASS" if not found else f"{what}: {'; '.join(found[:2])}: FAIL"


def pattern_verdict(label: str, calls, sends_to: list[int], receives_from: list[int]) -> str:
    """One verdict: the rank sent exactly to `sends_to` and received exactly from `receives_from`, in that order.
    A FAIL says what the rank did (not what it should have done)."""
    receive_ops = tuple(op for op in probe.P2P if op != "send")
    sent, received = _peers(calls, ("send",)), _peers(calls, receive_ops)
    wrong = []
    if sent != sends_to:
        wrong.append(f"sent {len(sent)} messages, to ranks {sent}")
    if received != receives_from:
        wrong.append(f"received {len(received)}, from ranks {received}")
    return f"{label}: PASS" if not wrong else f"{label}: found {'; '.join(wrong)}: FAIL"


def ring_verdicts(label: str, r: int, world: int, calls, expected: list[torch.Tensor]) -> list[str]:
    """Rank r's calls against the ring: sends only right, receives only left, as many as expected, each message
    the one expected."""
    right, left, n = (r + 1) % world, (r - 1) % world, len(expected)
    what = f"{label}rank {r}: {n} sends to rank {right}, {n} receives from rank {left}"
    lines = [pattern_verdict(what, calls, [right] * n, [left] * n)]
    sent = [c.get("data") for c in calls if c["op"] == "send"]
    lines.append(compare(f"{label}rank {r}: the messages it sent", sent, expected, against="the ring's").line)
    return lines


def _bytes(messages: list[torch.Tensor]) -> int:
    return sum(m.numel() * m.element_size() for m in messages)


# ------------------------------------------------------------------------------------ 1 · the reduce-scatter


def _run_reduce_scatter(phase, numel: int) -> dict:
    world, r = dist.get_world_size(), dist.get_rank()
    chunks = [c.clone() for c in rank_input(r, numel).tensor_split(world)]
    with probe.recording() as calls:
        phase(chunks)
    return {"chunks": chunks, "calls": calls}


def collect_reduce_scatter(reduce_scatter_phase) -> dict:
    return {"ranks": list(parlab.launch(_run_reduce_scatter, P, reduce_scatter_phase, NUMEL, **LAUNCH))}


def judge_reduce_scatter(data) -> list[str]:
    ranks = data["ranks"]
    total = sum(rank_input(q, NUMEL) for q in range(P)).tensor_split(P)  # the single-device reference, chunked
    lines = [collective_verdict("", [res["calls"] for res in ranks])]
    lines += [compare(f"rank {r} holds the sum of chunk {r}", ranks[r]["chunks"][r], total[r]).line for r in range(P)]
    for r in range(P):
        expected = reduce_scatter_messages(r, P, NUMEL)
        lines += ring_verdicts("", r, P, ranks[r]["calls"], expected)
        sent = probe.total_bytes(ranks[r]["calls"], "send")
        lines.append(check_equal(f"bytes sent by rank {r} (P-1 chunks)", sent, _bytes(expected)).line)
    return lines


# ---------------------------------------------------------------------------------------- 2 · the all-gather


def _run_all_gather(phase, numel: int) -> dict:
    world, r = dist.get_world_size(), dist.get_rank()
    total = sum(rank_input(q, numel) for q in range(world)).tensor_split(world)
    # The state after a correct reduce-scatter: chunk r finished on rank r, the others unknown (NaN).
    chunks = [total[c].clone() if c == r else torch.full_like(total[c], float("nan")) for c in range(world)]
    with probe.recording() as calls:
        phase(chunks)
    return {"gathered": torch.cat(chunks), "calls": calls}


def collect_all_gather(all_gather_phase) -> dict:
    return {"ranks": list(parlab.launch(_run_all_gather, P, all_gather_phase, NUMEL, **LAUNCH))}


def judge_all_gather(data) -> list[str]:
    ranks = data["ranks"]
    total = sum(rank_input(q, NUMEL) for q in range(P))
    lines = [collective_verdict("", [res["calls"] for res in ranks])]
    lines += [compare(f"rank {r} holds every summed chunk", ranks[r]["gathered"], total).line for r in range(P)]
    for r in range(P):
        expected = all_gather_messages(r, P, NUMEL)
        lines += ring_verdicts("", r, P, ranks[r]["calls"], expected)
        sent = probe.total_bytes(ranks[r]["calls"], "send")
        lines.append(check_equal(f"bytes sent by rank {r} (P-1 chunks)", sent, _bytes(expected)).line)
    return lines


# --------------------------------------------------------------------------------------- 3 · the whole ring


def _run_ring(reduce_scatter_phase, all_gather_phase, numel: int, dtype=torch.float64) -> dict:
    x = rank_input(dist.get_rank(), numel, dtype)
    with probe.recording() as calls:
        total = ring_all_reduce(x, reduce_scatter_phase, all_gather_phase)
    return {"total": total, "calls": calls}


def collect_ring_all_reduce(reduce_scatter_phase, all_gather_phase) -> dict:
    runs = {}
    for world, numel in RING_CASES:
        results = parlab.launch(_run_ring, world, reduce_scatter_phase, all_gather_phase, numel, **LAUNCH)
        runs[f"{world},{numel}"] = list(results)
    return {"runs": runs}


def judge_ring_all_reduce(data) -> list[str]:
    lines = []
    for world, numel in RING_CASES:
        ranks = data["runs"][f"{world},{numel}"]
        total = sum(rank_input(q, numel) for q in range(world))
        case = f"P={world}, N={numel}: "
        lines.append(collective_verdict(case, [res["calls"] for res in ranks]))
        lines.append(
            compare(f"{case}the all-reduce on every rank", [res["total"] for res in ranks], [total] * world).line
        )
        for r in range(world):
            expected = reduce_scatter_messages(r, world, numel) + all_gather_messages(r, world, numel)
            lines += ring_verdicts(case, r, world, ranks[r]["calls"], expected)
            sent = probe.total_bytes(ranks[r]["calls"], "send")
            lines.append(check_equal(f"{case}bytes sent by rank {r}", sent, _bytes(expected)).line)
    return lines


# ------------------------------------------------------------------------------- the prediction: ring traffic


def ring_bytes_theory(r: int, world: int, numel: int, dtype=torch.float64) -> int:
    """Bytes rank r hands to isend in the whole ring: the sizes of the messages it must send."""
    return _bytes(reduce_scatter_messages(r, world, numel, dtype) + all_gather_messages(r, world, numel, dtype))


def collect_ring_traffic(bytes_rank0, bytes_rank2, reduce_scatter_phase, all_gather_phase) -> dict:
    """The predictions as numbers, and (shown, not scored) what the student's own ring handed to isend."""
    world, numel, dtype = PREDICTED
    data = {"predicted": {"0": _plain(bytes_rank0), "2": _plain(bytes_rank2)}, "measured": {}, "note": ""}
    try:
        ranks = parlab.launch(_run_ring, world, reduce_scatter_phase, all_gather_phase, numel, dtype, **LAUNCH)
        data["measured"] = {str(r): float(probe.total_bytes(ranks[r]["calls"], "send")) for r in PREDICTED_RANKS}
    except Exception as exc:  # the prediction is graded all the same; only the measurement is missing
        data["note"] = f"your ring did not run ({type(exc).__name__}): nothing measured"
    return data


def _plain(value):
    """A prediction as plain data for the grader: a float if it is a number, else its repr (which FAILs)."""
    try:
        return float(value.item() if hasattr(value, "item") else value) if not isinstance(value, bool) else repr(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def judge_ring_traffic(data) -> list[str]:
    world, numel, dtype = PREDICTED
    predicted, measured = data["predicted"], data.get("measured") or {}
    lines = []
    for r in PREDICTED_RANKS:
        label = f"bytes rank {r} hands to isend (P={world}, N={numel}, float32)"
        lines += prediction_lines(label, predicted.get(str(r)), ring_bytes_theory(r, world, numel, dtype))
        if str(r) in measured:
            lines.append(f"{label}: measured in your ring {measured[str(r)]:,.0f}")
    if data.get("note"):
        lines.append(data["note"])
    return lines


# ---------------------------------------------------------------------- 4 · recursive halving and doubling


def halving_doubling_partners(r: int, world: int) -> list[int]:
    """Rank r's partner at each step, both phases (what the judge expects; a FAIL line never prints it)."""
    distances = []
    d = world // 2
    while d >= 1:
        distances.append(d)
        d //= 2
    return [r ^ d for d in distances] + [r ^ d for d in reversed(distances)]


def halving_doubling_messages(r: int, world: int, numel: int) -> list[torch.Tensor]:
    """What rank r must send at each step, from the inputs alone.

    Before the step at distance d of the first phase, rank r's data sums the ranks q that differ from r only in the
    bits above d; it hands its partner the block of d chunks the partner goes on with. In the second phase it
    hands its partner the finished block of d chunks it holds."""
    inputs = [_chunks(q, world, numel) for q in range(world)]
    total = sum(rank_input(q, numel) for q in range(world)).tensor_split(world)
    messages = []
    for step, p in enumerate(halving_doubling_partners(r, world)):
        d = r ^ p
        if step < len(halving_doubling_partners(r, world)) // 2:
            first = p & ~(d - 1)  # the partner's block of chunks
            group = [q for q in range(world) if (q ^ r) & (2 * d - 1) == 0]
            messages.append(torch.cat([sum(inputs[q][c] for q in group) for c in range(first, first + d)]))
        else:
            first = r & ~(d - 1)  # this rank's finished block
            messages.append(torch.cat([total[c] for c in range(first, first + d)]))
    return messages


def _run_halving_doubling(answer, numel: int) -> dict:
    x = rank_input(dist.get_rank(), numel)
    with probe.recording() as calls:
        total = answer(x.clone())
    return {"total": total, "calls": calls}


def collect_halving_doubling(halving_doubling_all_reduce) -> dict:
    runs = {}
    for world, numel in HALVING_CASES:
        results = parlab.launch(_run_halving_doubling, world, halving_doubling_all_reduce, numel, **LAUNCH)
        runs[f"{world},{numel}"] = list(results)
    return {"runs": runs}


def judge_halving_doubling(data) -> list[str]:
    lines = []
    for world, numel in HALVING_CASES:
        ranks = data["runs"][f"{world},{numel}"]
        total = sum(rank_input(q, numel) for q in range(world))
        case = f"P={world}, N={numel}: "
        lines.append(collective_verdict(case, [res["calls"] for res in ranks]))
        lines.append(
            compare(f"{case}the all-reduce on every rank", [res["total"] for res in ranks], [total] * world).line
        )
        steps = 2 * (world.bit_length() - 1)
        patterns, sent, expected = [], [], []
        for r in range(world):
            partners = halving_doubling_partners(r, world)
            what = f"rank {r}"
            patterns.append(pattern_verdict(what, ranks[r]["calls"], partners, partners))
            sent.append([c.get("data") for c in ranks[r]["calls"] if c["op"] == "send"])
            expected.append(halving_doubling_messages(r, world, numel))
        wrong = [line.removesuffix(": FAIL") for line in patterns if line.endswith(": FAIL")]
        what = f"{case}every rank: {steps} exchanges, one partner each"
        lines.append(f"{what}: PASS" if not wrong else f"{what}: {'; '.join(wrong[:2])}: FAIL")
        lines.append(compare(f"{case}the messages every rank sent", sent, expected, against="halving/doubling's").line)
        theory = 2 * (world - 1) * (numel // world) * 8
        for r in range(world):
            measured = probe.total_bytes(ranks[r]["calls"], "send")
            lines.append(check_equal(f"{case}bytes sent by rank {r}", measured, theory).line)
    return lines
