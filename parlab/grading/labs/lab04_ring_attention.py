"""Lab 04's checks: the online-softmax merge, one overlapped ring step, causal ring attention in any chunk layout,
and a prediction of the busiest rank's causal work.

Every tile the student computes goes through `attend` (below), which, on a rank the check is recording, notes which
query and key chunk it was given, whether it was masked, and when it ran. So the checks see, beyond the numbers:
which tiles each rank computed (the causal ones, each once), that the K/V transfer was in flight while the tile
computed (parlab.core.comm's trace: issued before, waited after), and what each rank sent to whom
(parlab.core.probe). Calls into the library's own sequence-parallel code (parlab/schemes/sequence/ring_attention.py,
parlab/schemes/sequence/ulysses.py, ...) are seen too (a profile hook): the lab asks for the student's own.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core import comm, probe
from parlab.core.check import compare
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a send nobody receives) stops after 60 s and names the ranks
P, B, NH, HS = 4, 1, 2, 4  # ranks; q, k, v: [B, NH, T, HS]
T_RING = 16  # part 2: rank r holds tokens [r*T/P, (r+1)*T/P)
T_CAUSAL = 24  # part 4: the sequence cut into P * n chunks, rank j holds the chunks LAYOUTS[name][j]
LAYOUTS = {
    "contiguous": [[0], [1], [2], [3]],
    "zigzag": [[0, 7], [1, 6], [2, 5], [3, 4]],
    "shuffled": [[7, 0, 9], [4, 11, 2], [10, 1, 5], [3, 8, 6]],  # 12 chunks, in no particular order
}
T_WORK = 32  # the prediction: causal attention over T_WORK tokens on P ranks, contiguous and zigzag
MERGE_CASES = {  # name: (where the keys are cut into blocks, a factor on q: large scores make exp(lse) overflow)
    "two halves": ((8,), 1.0),
    "uneven blocks 3 + 13": ((3,), 1.0),
    "three blocks merged left to right": ((5, 11), 1.0),
    "scores in the thousands (exp(lse) overflows)": ((8,), 2000.0),
}
LIBRARY = ("schemes/sequence/", "lessons/sequence_parallel.py")  # parlab/grading/labs/guard.py

STRUCTURAL = {
    "merge": "the merged output and log-sum-exp equal attention over all the keys for two, uneven and three blocks, "
    "and for scores in the thousands, where exp(lse) overflows float64; the library's merge is not called",
    "ring": "per rank: K/V sent only to the right neighbour and received only from the left, no library collective; "
    "the block sent at step s is rank r-s's (the ring passes the blocks on); at every step the transfer was issued "
    "before the tile computed and waited for after it (parlab.core.comm's trace); outputs and log-sum-exps equal "
    "attention over the whole sequence",
    "causal": "for the contiguous, zigzag and a shuffled layout: outputs equal causal attention over the whole "
    "sequence (float64); each rank computed exactly the tiles a causal mask leaves, each once, masked only on the "
    "diagonal (attend's own record); with zigzag every rank computed the same number of tiles; P-1 K/V transfers "
    "per rank, to the right neighbour only, the block of rank r-s at step s; no library collective or library code",
    "work": "the predicted score counts of the busiest rank (contiguous, zigzag) against the count of the causal "
    "tiles, and that count measured from the tiles parlab.schemes.sequence.ring_attention computed on live ranks",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ------------------------------------------------------------------------------------------- the problem


def full_problem(seed: int = 0, seq: int = T_RING, scale: float = 1.0):
    """q, k, v: [B, NH, seq, HS] float64, drawn from a seed (q multiplied by `scale`)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, NH, seq, HS, generator=gen, dtype=torch.float64) for _ in range(3))
    return q * scale, k, v


def chunk(x: torch.Tensor, c: int, size: int) -> torch.Tensor:
    """Chunk number c of x's sequence (dim -2) cut into pieces of `size` tokens."""
    return x[..., c * size : (c + 1) * size, :]


def blocks_of(x: torch.Tensor, layout: list[list[int]]) -> list[torch.Tensor]:
    """Each rank's block of x: its chunks layout[j], in that order, concatenated along the sequence."""
    size = x.shape[-2] // sum(len(chunks) for chunks in layout)
    return [torch.cat([chunk(x, c, size) for c in chunks], dim=-2) for chunks in layout]


# ------------------------------------------------------------------------------------------- attention of a tile

_LOG: list | None = None  # on a rank while a check records: one entry per attend call
_CHUNKS: dict | None = None  # {"q": [...], "k": [...]}: the problem's chunks, to name the tiles attend is given


def _which(x: torch.Tensor, kind: str) -> int:
    """The chunk number of the problem that `x` is (-1: none of them)."""
    for number, piece in enumerate(_CHUNKS[kind] if _CHUNKS else []):
        if x.shape == piece.shape and torch.equal(x, piece):
            return number
    return -1


def attend(q, k, v, diagonal: bool = False):
    """Attention of the queries q [..., Tq, hs] on one block of keys and values k, v [..., Tk, hs].

    Returns (out [..., Tq, hs], normalised over these keys only; lse [..., Tq], the log-sum-exp of the scores
    q k^T / sqrt(hs) over these keys). diagonal=True: a tile on the diagonal of the causal score matrix (query and
    key chunk are the same chunk of the sequence): query i sees only keys j <= i of the tile.
    """
    start = time.perf_counter()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [..., Tq, Tk]
    if diagonal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [..., Tq]
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v
    if _LOG is not None:
        _LOG.append(
            {
                "q": _which(q, "q"),
                "k": _which(k, "k"),
                "diagonal": bool(diagonal),
                "start": start,
                "end": time.perf_counter(),
            }
        )
    return out, lse


def full_attention(q, k, v):
    """The reference: out and lse over all the keys at once, on one device (no mask)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, NH, Tq, Tk]
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


# --------------------------------------------------------------------------------------- what the ranks did


def _library_line(what: str, called: list[str]) -> str:
    return library_line(what, called, "the library's sequence-parallel code")


def _tensor(x, shape) -> torch.Tensor | None:
    """x if it is a tensor of this shape (detached), else None."""
    if isinstance(x, torch.Tensor) and list(x.shape) == list(shape):
        return x.detach().to(torch.float64).clone()
    return None


def _recording(chunks: dict):
    global _LOG, _CHUNKS
    _LOG, _CHUNKS = [], chunks
    return _LOG


def _comm_events(since: float) -> list[dict]:
    """This rank's traced sends and receives issued after `since`: issued (start) and waited for (end)."""
    return [
        {
            "kind": e.kind,
            "peer": -1 if e.peer is None else int(e.peer),
            "start": e.start,
            "end": -1.0 if e.end is None else e.end,
        }
        for e in comm.trace_events()
        if e.kind in ("send", "recv") and e.start >= since
    ]


def _p2p_wrong(calls, r: int) -> list[str]:
    right, left = (r + 1) % P, (r - 1) % P
    sends = [c for c in calls if c["op"] == "send"]
    recvs = [c for c in calls if c["op"] in probe.P2P and c["op"] != "send"]
    wrong = []
    if probe.library_collectives(calls):
        wrong.append(f"library collective(s) {sorted(set(probe.library_collectives(calls)))}")
    if not sends or {c["peer"] for c in sends} != {right}:
        wrong.append(f"sent to ranks {[c['peer'] for c in sends]}")
    if not recvs or {c["peer"] for c in recvs} != {left}:
        wrong.append(f"received from ranks {[c['peer'] for c in recvs]}")
    return wrong


def _sent(calls) -> torch.Tensor:
    sent = [c["data"].to(torch.float64) for c in calls if c["op"] == "send" and "data" in c]
    return torch.cat(sent) if sent else torch.zeros(0, dtype=torch.float64)


# ------------------------------------------------------------------------------------------- 1 · the merge


def collect_merge(merge) -> dict:
    results = {}
    with library_calls(LIBRARY) as called:
        for name, (cuts, scale) in MERGE_CASES.items():
            q, k, v = full_problem(1, T_RING, scale)
            bounds = [0, *cuts, T_RING]
            out = lse = None
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                o, block_lse = attend(q, k[..., lo:hi, :], v[..., lo:hi, :])
                out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
            results[name] = {"out": torch.as_tensor(out).detach(), "lse": torch.as_tensor(lse).detach()}
    return {"cases": results, "library": list(called)}


def judge_merge(data) -> list[str]:
    lines = []
    for name, (_, scale) in MERGE_CASES.items():
        out, lse = full_attention(*full_problem(1, T_RING, scale))
        got = data["cases"][name]
        against = "attention over all the keys"
        lines.append(compare(f"{name}: merged output", got["out"], out, against=against).line)
        lines.append(compare(f"{name}: merged log-sum-exp", got["lse"], lse, against=against).line)
    lines.append(_library_line("merge", data["library"]))
    return lines


# ------------------------------------------------------------------------------------------- 2 · one ring step


def ring_forward(q, k, v, ring_step):
    """Rank code: P calls of the student's ring_step, from this rank's own K/V block and no result yet.
    Returns the result and the time each step began (the check reads the trace and the tiles between them)."""
    out = lse = None
    starts = []
    for _ in range(dist.get_world_size()):
        starts.append(time.perf_counter())
        out, lse, k, v = ring_step(q, k, v, out, lse)
    return out, lse, starts


def _run_ring(ring_step) -> dict:
    r, n = dist.get_rank(), T_RING // P
    q, k, v = full_problem(2)
    tiles = _recording({"q": [chunk(q, j, n) for j in range(P)], "k": [chunk(k, j, n) for j in range(P)]})
    since = time.perf_counter()
    with probe.recording() as calls, library_calls(LIBRARY) as called:
        out, lse, starts = ring_forward(
            chunk(q, r, n).clone(), chunk(k, r, n).clone(), chunk(v, r, n).clone(), ring_step
        )
    return {
        "out": _tensor(out, [B, NH, n, HS]),
        "lse": _tensor(lse, [B, NH, n]),
        "calls": calls,
        "tiles": list(tiles),
        "comm": _comm_events(since),
        "starts": starts + [time.perf_counter()],
        "library": list(called),
    }


def collect_ring(ring_step) -> dict:
    return {"ranks": list(parlab.launch(_run_ring, P, ring_step, **LAUNCH))}


def _overlap_wrong(rank: dict) -> list[str]:
    """What is wrong with the overlap of each step: the K/V transfer issued before the tile, waited for after."""
    wrong = []
    starts = rank["starts"]
    for s in range(P):
        lo, hi = starts[s], starts[s + 1]
        tiles = [t for t in rank["tiles"] if lo <= t["start"] < hi]
        events = [e for e in rank["comm"] if lo <= e["start"] < hi]
        kinds = sorted(e["kind"] for e in events)
        if not tiles:
            wrong.append(f"step {s}: no tile computed with attend")
        elif set(kinds) != {"recv", "send"}:
            wrong.append(f"step {s}: parlab.core.comm calls {kinds} (a send and a receive expected)")
        elif any(e["start"] > tiles[0]["start"] for e in events):
            wrong.append(f"step {s}: a transfer issued after the tile began")
        elif any(e["end"] < tiles[-1]["end"] for e in events):
            wrong.append(f"step {s}: a transfer waited for before the tile was done (or never)")
    return wrong


def judge_ring(data) -> list[str]:
    ranks, (q, k, v), n = data["ranks"], full_problem(2), T_RING // P
    out, lse = full_attention(q, k, v)
    against = "attention over the whole sequence"
    outs = [res["out"] if res["out"] is not None else torch.full((B, NH, n, HS), math.nan) for res in ranks]
    lses = [res["lse"] if res["lse"] is not None else torch.full((B, NH, n), math.nan) for res in ranks]
    lines = [
        compare("output, the ranks' blocks in order", torch.cat(outs, 2), out, against=against).line,
        compare("log-sum-exp, the ranks' blocks in order", torch.cat(lses, 2), lse, against=against).line,
    ]
    blocks = [torch.cat([chunk(k, j, n).flatten(), chunk(v, j, n).flatten()]) for j in range(P)]
    for r in range(P):
        calls, right, left = ranks[r]["calls"], (r + 1) % P, (r - 1) % P
        wrong = _p2p_wrong(calls, r)
        what = f"rank {r}: K/V sent only to rank {right}, received only from rank {left}, no collective"
        lines.append(f"{what}: PASS" if not wrong else f"{what}: found {'; '.join(wrong)}: FAIL")
        expected = torch.cat([blocks[(r - s) % P] for s in range(P)])  # step s: the block of rank r-s
        lines.append(
            compare(
                f"rank {r}: what it sent, step by step (K then V)",
                _sent(calls),
                expected,
                against="the ring's blocks",
            ).line
        )
        wrong = _overlap_wrong(ranks[r])
        what = f"rank {r}: at every step the K/V transfer was in flight while the tile computed"
        lines.append(f"{what}: PASS" if not wrong else f"{what}: {'; '.join(wrong[:2])}: FAIL")
    lines.append(_library_line("ring_step", [name for res in ranks for name in res["library"]]))
    return lines


# ------------------------------------------------------------------------------------------- 3 · the prediction


def _library_tiles(layouts) -> dict:
    """Rank code: the library's causal ring attention once per layout; the tiles it computed, from its trace."""
    from parlab.schemes.sequence.ring_attention import ring_attention, sequence_split

    r, counts = dist.get_rank(), {}
    for layout in layouts:
        since = time.perf_counter()
        q, k, v = (sequence_split(t, r, P, 2, layout) for t in full_problem(3, T_WORK))
        ring_attention(q, k, v, causal=True, layout=layout)
        spans = [e for e in comm.trace_events() if e.start >= since and e.extra.get("attn") == "fwd"]
        counts[layout] = len(spans)
    return counts


def _causal_tiles(layout: list[list[int]]) -> list[set]:
    """Per rank, the tiles (q chunk, k chunk, masked) a causal mask leaves of rank r's queries, by enumeration."""
    every = sorted(c for chunks in layout for c in chunks)
    return [{(qc, kc, kc == qc) for qc in chunks for kc in every if kc <= qc} for chunks in layout]


def _plain(value) -> float | str:
    """A prediction as a float when it is one number (a tensor or NumPy scalar too), else a short text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(value.item())
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return repr(value)[:40]


def collect_work(predicted: dict) -> dict:
    tiles = parlab.launch(_library_tiles, P, ["contiguous", "zigzag"], **LAUNCH)
    return {"predicted": {str(k): _plain(v) for k, v in predicted.items()}, "tiles": [dict(rank) for rank in tiles]}


def judge_work(data) -> list[str]:
    lines = []
    for layout, chunks_per_rank in (("contiguous", 1), ("zigzag", 2)):
        table = [[r] for r in range(P)] if layout == "contiguous" else LAYOUTS["zigzag"]
        side = T_WORK // (P * chunks_per_rank)  # a tile is side x side scores
        theory = max(len(tiles) for tiles in _causal_tiles(table)) * side * side
        measured = max(rank[layout] for rank in data["tiles"]) * side * side
        name = f"scores_{layout}"
        label = f"{name} (scores the busiest rank computes, {layout})"
        lines += prediction_lines(label, data["predicted"].get(name), theory, measured)
    return lines


# ------------------------------------------------------------------------------------------- 4 · causal, any layout


def _run_causal(causal_attention) -> dict:
    r, results = dist.get_rank(), {}
    q, k, v = full_problem(4, T_CAUSAL)
    for name, layout in LAYOUTS.items():
        n = len(layout[r])
        size = T_CAUSAL // (P * n)
        every = range(P * n)
        tiles = _recording({"q": [chunk(q, c, size) for c in every], "k": [chunk(k, c, size) for c in every]})
        mine = [blocks_of(t, layout)[r].clone() for t in (q, k, v)]
        with probe.recording() as calls, library_calls(LIBRARY) as called:
            out = causal_attention(*mine, layout)
        results[name] = {
            "out": _tensor(out, [B, NH, n * size, HS]),
            "tiles": [[t["q"], t["k"], t["diagonal"]] for t in tiles],
            "calls": calls,
            "library": list(called),
        }
    return results


def collect_causal(causal_attention) -> dict:
    return {"ranks": list(parlab.launch(_run_causal, P, causal_attention, **LAUNCH))}


def _tiles_wrong(got: list, expected: set) -> str:
    tiles = [tuple(t) for t in got]
    unknown = sum(1 for t in tiles if t[0] < 0 or t[1] < 0)
    twice = sorted({t[:2] for t in tiles if tiles.count(t) > 1})
    missing = sorted(t[:2] for t in expected - set(tiles))
    extra = sorted(t[:2] for t in set(tiles) - expected if t[0] >= 0 and t[1] >= 0)
    wrong = [f"{unknown} not one chunk by one chunk"] if unknown else []
    wrong += [
        f"{what} {pairs[:3]}"
        for what, pairs in (("twice", twice), ("missing", missing), ("extra or masked wrong", extra))
        if pairs
    ]
    return ", ".join(wrong)


def judge_causal(data) -> list[str]:
    ranks, (q, k, v) = data["ranks"], full_problem(4, T_CAUSAL)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, NH, T, HS]
    lines = []
    for name, layout in LAYOUTS.items():
        n = len(layout[0])
        size = T_CAUSAL // (P * n)
        pieces = {}
        for r in range(P):
            out = ranks[r][name]["out"]
            out = out if out is not None else torch.full((B, NH, n * size, HS), math.nan)
            for i, c in enumerate(layout[r]):
                pieces[c] = chunk(out, i, size)
        got = torch.cat([pieces[c] for c in range(P * n)], dim=-2)
        lines.append(
            compare(
                f"{name}: output, the ranks' chunks in sequence order",
                got,
                reference,
                against="causal sdpa on the whole sequence",
            ).line
        )
        expected = _causal_tiles(layout)
        wrong = [f"rank {r}: {w}" for r in range(P) if (w := _tiles_wrong(ranks[r][name]["tiles"], expected[r]))]
        what = f"{name}: each rank computed exactly its causal tiles, once each, masked only on the diagonal"
        lines.append(f"{what}: PASS" if not wrong else f"{what}: {'; '.join(wrong[:2])}: FAIL")
        wrong = []
        for r in range(P):
            calls = ranks[r][name]["calls"]
            problems = _p2p_wrong(calls, r)
            held = [torch.cat([blocks_of(t, layout)[(r - s) % P].flatten() for t in (k, v)]) for s in range(P - 1)]
            if not compare("", _sent(calls), torch.cat(held)).passed:
                sends = len([c for c in calls if c["op"] == "send"])
                problems.append(f"its {sends} send(s) are not the K/V blocks of ranks r, r-1, ..., r-P+2")
            wrong += [f"rank {r}: {'; '.join(problems)}"] if problems else []
        what = f"{name}: K/V passed on P-1 times, rank r-s's block at step s, right neighbour only, no collective"
        lines.append(f"{what}: PASS" if not wrong else f"{what}: {'; '.join(wrong[:2])}: FAIL")
    counts = [len(ranks[r]["zigzag"]["tiles"]) for r in range(P)]
    what = f"zigzag: tiles computed per rank {counts}, the same on every rank"
    lines.append(f"{what}: PASS" if len(set(counts)) == 1 and counts[0] > 0 else f"{what}: FAIL")
    called = [f for res in ranks for layout in res.values() for f in layout["library"]]
    lines.append(_library_line("causal_attention", called))
    return lines
