"""Lab 00's checks: the student's ring all-reduce, on live ranks (see parlab/grading/__init__.py for the scheme).

Beyond "every rank holds the right sum", each check verifies from what the ranks handed to torch.distributed
(parlab.grading.probe) that the sum was computed by the student's own ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.check import check_equal, compare
from parlab.collectives import ring_theory_bytes
from parlab.grading import probe, run_check

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a send nobody receives) stops after 60 s and names the ranks
P, NUMEL = 4, 1000  # the phases' checks; the whole ring also runs on RING_CASES
RING_CASES = [(3, 10), (4, 1000)]  # (P, N): chunks of 4, 3, 3 elements; of 250

STRUCTURAL = {
    "reduce_scatter": "every rank sends P-1 messages, only to its right neighbour, receives P-1 only from its left, "
    "calls no library collective, and each message it sends is the partial sum the ring sends at that step",
    "all_gather": "the same ring pattern; each message is the finished chunk the ring passes on at that step",
    "ring_all_reduce": "2(P-1) messages per rank on the ring, the partial sums then the finished chunks, no library "
    "collective, bytes per rank as the ring's theory; P=3 with uneven chunks",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def rank_input(rank: int, numel: int) -> torch.Tensor:
    """What rank `rank` contributes: [numel] float64, drawn from a seed so the parent can redraw it."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


def ring_all_reduce(x: torch.Tensor, reduce_scatter_phase, all_gather_phase) -> torch.Tensor:
    """x: [N] on every rank -> the sum over ranks, [N], on every rank: your two phases, one after the other."""
    chunks = [c.clone() for c in x.tensor_split(dist.get_world_size())]
    reduce_scatter_phase(chunks)
    all_gather_phase(chunks)
    return torch.cat(chunks)


# ------------------------------------------------------------------------------------- what the ring must send


def reduce_scatter_messages(r: int, P: int, numel: int) -> list[torch.Tensor]:
    """What rank r sends at each step of the reduce-scatter: chunk (r - s) mod P summed over ranks r-s..r."""
    chunks = [[c for c in rank_input(q, numel).tensor_split(P)] for q in range(P)]
    return [sum(chunks[(r - k) % P][(r - s) % P] for k in range(s + 1)) for s in range(P - 1)]


def all_gather_messages(r: int, P: int, numel: int) -> list[torch.Tensor]:
    """What rank r sends at each step of the all-gather: the finished chunk (r + 1 - s) mod P."""
    total = sum(rank_input(q, numel) for q in range(P)).tensor_split(P)
    return [total[(r + 1 - s) % P] for s in range(P - 1)]


def ring_verdicts(label: str, r: int, P: int, calls, expected: list[torch.Tensor]) -> list[str]:
    """Rank r's calls against the ring: sends only right, receives only left, as many as expected, no collective,
    each message the one expected."""
    right, left = (r + 1) % P, (r - 1) % P
    collectives = probe.library_collectives(calls)
    sends = [c for c in calls if c["op"] == "send"]
    recvs = [c for c in calls if c["op"] in probe.P2P and c["op"] != "send"]
    n = len(expected)
    what = f"{label}rank {r}: {n} sends to rank {right}, {n} receives from rank {left}, no collective"
    wrong = []
    if collectives:
        wrong.append(f"library collective(s) {sorted(set(collectives))}")
    if [c["peer"] for c in sends] != [right] * len(expected):
        wrong.append(f"sent to ranks {[c['peer'] for c in sends]}")
    if [c["peer"] for c in recvs] != [left] * len(expected):
        wrong.append(f"received from ranks {[c['peer'] for c in recvs]}")
    lines = [f"{what}: PASS" if not wrong else f"{what}: found {'; '.join(wrong)}: FAIL"]
    sent = [c.get("data") for c in sends]
    lines.append(
        compare(f"{label}rank {r}: the messages it sent", sent, expected, show=False, against="the ring's").line
    )
    return lines


# ------------------------------------------------------------------------------------------------ the checks


def _run_reduce_scatter(phase, numel: int) -> dict:
    P, r = dist.get_world_size(), dist.get_rank()
    chunks = [c.clone() for c in rank_input(r, numel).tensor_split(P)]
    with probe.recording() as calls:
        phase(chunks)
    return {"chunks": chunks, "calls": calls}


def collect_reduce_scatter(reduce_scatter_phase) -> dict:
    return {"ranks": list(parlab.launch(_run_reduce_scatter, P, reduce_scatter_phase, NUMEL, **LAUNCH))}


def judge_reduce_scatter(data) -> list[str]:
    ranks = data["ranks"]
    total = sum(rank_input(q, NUMEL) for q in range(P)).tensor_split(P)  # the single-device reference, chunked
    lines = []
    for r in range(P):
        mine = (r + 1) % P
        lines.append(
            compare(f"rank {r} holds the sum of chunk {mine}", ranks[r]["chunks"][mine], total[mine], show=False).line
        )
    for r in range(P):
        lines += ring_verdicts("", r, P, ranks[r]["calls"], reduce_scatter_messages(r, P, NUMEL))
    for r in range(P):
        sent = probe.total_bytes(ranks[r]["calls"], "send")
        lines.append(
            check_equal(f"bytes sent by rank {r} (P-1 chunks)", sent, (P - 1) * (NUMEL // P) * 8, show=False).line
        )
    return lines


def _run_all_gather(phase, numel: int) -> dict:
    P, r = dist.get_world_size(), dist.get_rank()
    total = sum(rank_input(q, numel) for q in range(P)).tensor_split(P)
    mine = (r + 1) % P  # the state after a correct reduce-scatter: one finished chunk, the rest unknown
    chunks = [total[c].clone() if c == mine else torch.full_like(total[c], float("nan")) for c in range(P)]
    with probe.recording() as calls:
        phase(chunks)
    return {"gathered": torch.cat(chunks), "calls": calls}


def collect_all_gather(all_gather_phase) -> dict:
    return {"ranks": list(parlab.launch(_run_all_gather, P, all_gather_phase, NUMEL, **LAUNCH))}


def judge_all_gather(data) -> list[str]:
    ranks = data["ranks"]
    total = sum(rank_input(q, NUMEL) for q in range(P))
    lines = [
        compare(f"rank {r} holds every summed chunk", ranks[r]["gathered"], total, show=False).line for r in range(P)
    ]
    for r in range(P):
        lines += ring_verdicts("", r, P, ranks[r]["calls"], all_gather_messages(r, P, NUMEL))
    for r in range(P):
        sent = probe.total_bytes(ranks[r]["calls"], "send")
        lines.append(
            check_equal(f"bytes sent by rank {r} (P-1 chunks)", sent, (P - 1) * (NUMEL // P) * 8, show=False).line
        )
    return lines


def _run_ring(reduce_scatter_phase, all_gather_phase, numel: int) -> dict:
    x = rank_input(dist.get_rank(), numel)
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
        lines.append(
            compare(
                f"{case}the all-reduce on every rank", [res["total"] for res in ranks], [total] * world, show=False
            ).line
        )
        theory = ring_theory_bytes(numel, 8, world)
        for r in range(world):
            expected = reduce_scatter_messages(r, world, numel) + all_gather_messages(r, world, numel)
            lines += ring_verdicts(case, r, world, ranks[r]["calls"], expected)
            sent = probe.total_bytes(ranks[r]["calls"], "send")
            lines.append(check_equal(f"{case}bytes sent by rank {r}", sent, theory[r], show=False).line)
    return lines
