"""Lab 04's checks: the online-softmax merge (empty partial results included), one ring step of grouped-query
attention overlapped with its tile, a prediction of the causal work and the K/V traffic of the lab model's attention
on a ring, and the lab model's attention layer (GQA, RoPE with global positions) on a ring for any token layout:
striped (token t on rank t mod P, uneven when P does not divide T) and contiguous.

Every tile the student computes goes through `attend` (below), which, on a rank the check is recording, notes whose
queries and whose keys it was given (for each query head, which K/V head of which rank's block), the mask, and when
it ran. So the checks see, beyond the numbers: which tiles each rank computed and with which mask, whether the K/V
heads were expanded to the query heads the way grouped-query attention pairs them, whether the transfers were in
flight while the tiles computed (parlab.core.comm's trace: issued before, waited after), and what each rank sent to
whom (parlab.core.probe). Calls into the library's own sequence-parallel code (LIBRARY) are seen too (a profile
hook, parlab/grading/labs/guard.py): the lab asks for the student's own.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.check import compare
from parlab.core.lab_model import GQAttention, LabConfig, apply_rope, build_lab_model, gqa_attention
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a send nobody receives) stops within seconds and names the ranks
P, B = 4, 1  # ranks; batch
CFG = LabConfig(hidden=48, heads=6, kv_heads=2)  # nq = 6 query heads share nkv = 2 K/V heads, hd = 8
NQ, NKV, HD = CFG.heads, CFG.kv_heads, CFG.head_size
GROUP = NQ // NKV  # query heads per K/V head: query head h reads K/V head h // GROUP
T_RING = 16  # part 2: rank r holds tokens [r*T/P, (r+1)*T/P)
T_WORK = 40  # part 3: the prediction's sequence


def striped(T: int) -> list[list[int]]:
    """Token t on rank t mod P: rank j holds positions j, j+P, j+2P, ... (uneven when P does not divide T)."""
    return [list(range(j, T, P)) for j in range(P)]


def contiguous(T: int) -> list[list[int]]:
    """Rank j holds positions [j*T/P, (j+1)*T/P)."""
    return [list(range(j * T // P, (j + 1) * T // P)) for j in range(P)]


LAYOUTS = {  # part 4: layout[j] = the global positions of the tokens rank j holds, in its order
    "striped": striped(16),
    "striped, uneven": striped(18),  # ranks 0 and 1 hold 5 tokens, ranks 2 and 3 hold 4
    "contiguous": contiguous(16),
}
MERGE_CASES = {  # name: (where the keys are cut into blocks, a factor on q, which keys each query row may see)
    "two halves": ((8,), 1.0, "all"),
    "uneven blocks 3 + 13": ((3,), 1.0, "all"),
    "three blocks merged left to right": ((5, 11), 1.0, "all"),
    "scores in the thousands (exp(lse) overflows)": ((8,), 2000.0, "all"),
    "causal: rows 0-7 see no key of the second block": ((8,), 1.0, "causal"),
    "rows 0-2 see no key at all (out 0, lse -inf)": ((8,), 1.0, "from row 3"),
}
LIBRARY = ("schemes/sequence/", "lessons/sequence_parallel.py")  # parlab/grading/labs/guard.py

STRUCTURAL = {
    "merge": "the merged output and log-sum-exp equal attention over all the keys for two, uneven and three blocks, "
    "for scores in the thousands (exp(lse) overflows float64), for rows one block does not see (lse -inf) and for "
    "rows no block sees (out 0, lse -inf exactly); the library's merge is not called",
    "ring": "grouped-query attention, nq = 6 query heads on nkv = 2 K/V heads: outputs and log-sum-exps equal "
    "attention over the whole sequence; per rank: K/V sent only to the right neighbour and received only from the "
    "left, no collective; what it sent at step s is rank r-s's K then V with its nkv heads only (never expanded to "
    "nq); one tile per step, of its queries against rank r-s's K/V, query head h paired with K/V head h // 3; at "
    "every step both transfers issued before the tile and waited for after it (parlab.core.comm's trace); the "
    "FAIL lines name the first wrong rank and step with what was expected and what came",
    "work": "the predicted (query, key) pairs the causal mask leaves the busiest rank (contiguous and striped, "
    "T = 40 on 4 ranks) against the theory, and against the count on the causal mask; the predicted bytes a rank "
    "sends in the forward of one attention layer of the lab model (GQA: K and V of the nkv heads) against the "
    "theory and the bytes parlab's own ring measured on live ranks with those K/V heads",
    "layer": "the lab model's attention layer (projections, RoPE, GQA, causal mask, output projection) on 4 ranks "
    "for the striped, an uneven striped (18 tokens: 5, 5, 4, 4) and the contiguous layout: outputs equal the layer "
    "on one device (float64); each rank computed one tile per block holding a key its queries may see, none for "
    "the others, each once, its queries rotated by its tokens' global positions, the keys of the right rank "
    "expanded h // 3, with the mask of the global positions (not the diagonal); K/V passed on P-1 times to the "
    "right neighbour only, rank r-s's K then V (nkv heads, rotated or not) at step s; on the striped layouts "
    "every transfer in flight while a tile computed; no library code",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ------------------------------------------------------------------------------------------- the problems


def ring_problem(seed: int = 0, seq: int = T_RING, scale: float = 1.0):
    """q: [B, NQ, seq, HD], k, v: [B, NKV, seq, HD], float64, from a seed (q multiplied by `scale`)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NQ, seq, HD, generator=gen, dtype=torch.float64)  # host: the seeded draw
    k, v = (torch.randn(B, NKV, seq, HD, generator=gen, dtype=torch.float64) for _ in range(2))  # host: the same
    return q.to(parlab.device()) * scale, k.to(parlab.device()), v.to(parlab.device())


def merge_problem(seed: int, scale: float):
    """One query head per key head (the merge is about blocks of keys): q, k, v [B, 2, T_RING, HD]."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, 2, T_RING, HD, generator=gen, dtype=torch.float64) for _ in range(3))  # host: seeded
    return q * scale, k, v


def merge_mask(kind: str) -> torch.Tensor | None:
    """Which keys each query row may see: all, causal (key j <= row i), or only rows 3 on (keys j < i - 2)."""
    rows = torch.arange(T_RING)[:, None]  # host: the reference on one device
    cols = torch.arange(T_RING)[None, :]  # host: the reference on one device
    return {"all": None, "causal": cols <= rows, "from row 3": cols <= rows - 3}[kind]


def layer_model() -> GQAttention:
    """The attention of the lab model's first block (the weights every rank and the reference use), its q and k
    weights grown tenfold as training grows them: scores of a few units, so that a softmax picks its keys (at
    initialisation every score is ~0.02 and attention is a plain average, blind to most mistakes)."""
    attn = build_lab_model(CFG, seed=4).blocks[0].attn
    with torch.no_grad():
        attn.q.weight.mul_(10.0)
        attn.k.weight.mul_(10.0)
    return attn


def layer_input(T: int) -> torch.Tensor:
    """x: [B, T, H], the hidden states entering the attention layer."""
    gen = torch.Generator().manual_seed(100 + T)
    return torch.randn(B, T, CFG.hidden, generator=gen, dtype=torch.float64)  # host: the seeded draw


def chunk(x: torch.Tensor, j: int, size: int) -> torch.Tensor:
    """Chunk number j of x's sequence (dim -2) cut into pieces of `size` tokens."""
    return x[..., j * size : (j + 1) * size, :]


# ------------------------------------------------------------------------------------------- attention of a tile

_LOG: list | None = None  # on a rank while a check records: one entry per attend call
_KNOWN: dict | None = None  # {"q": [rank j's queries], "k": [rank j's keys, nkv heads]}: to name what attend gets


def _mask_text(mask: torch.Tensor | None, shape) -> str:
    """A mask as rows of 0/1 ("1000/1100/..."); None (every key visible) as all ones."""
    if mask is None:
        return "/".join("1" * shape[1] for _ in range(shape[0]))
    return "/".join("".join("1" if m else "0" for m in row) for row in mask.tolist())


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=0, atol=1e-9))


def _whose_queries(q: torch.Tensor) -> int:
    """The rank whose query block q is (-1: none of them)."""
    for j, known in enumerate(_KNOWN["q"] if _KNOWN else []):
        if _close(q, known):
            return j
    return -1


def _whose_keys(k: torch.Tensor) -> tuple[int, list[int] | None]:
    """(rank j, [the K/V head of rank j's block that each of k's heads is]) or (-1, None) when k's heads are not
    all heads of one rank's keys."""
    for j, known in enumerate(_KNOWN["k"] if _KNOWN else []):
        heads = []
        for h in range(k.shape[1]):
            match = [m for m in range(known.shape[1]) if _close(k[:, h], known[:, m])]
            if not match:
                break
            heads.append(match[0])
        else:
            return j, heads
    return -1, None


def attend(q, k, v, mask=None):
    """Attention of queries q [B, nh, Tq, hd] on one block of keys and values k, v [B, nh, Tk, hd] (as many heads
    as q: query head h attends with k[:, h], v[:, h]).

    mask: None (every key visible) or a bool tensor [Tq, Tk], True where query i may see key j. Returns (out
    [B, nh, Tq, hd], normalised over the visible keys of this block only; lse [B, nh, Tq], the log-sum-exp of the
    visible scores q k^T / sqrt(hd)). A query row that sees no key of the block gets out 0 and lse -inf.
    """
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(
            f"attend: q has {q.shape[1]} heads, k {k.shape[1]} and v {v.shape[1]}: give k and v one head per "
            "query head (query head h attends with k[:, h] and v[:, h])"
        )
    start = time.perf_counter()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, nh, Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask.to(torch.bool), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [B, nh, Tq]; -inf on a row with no visible key
    out = torch.softmax(scores, dim=-1) @ v  # NaN on such a row (0/0): it sees nothing, so its output is 0
    out = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(out), out)
    if _LOG is not None:
        owner, heads = _whose_keys(k.detach())
        _LOG.append(
            {
                "q": _whose_queries(q.detach()),
                "k": owner,
                "heads": heads,
                "mask": _mask_text(mask, scores.shape[-2:]),
                "start": start,
                "end": time.perf_counter(),
            }
        )
    return out, lse


def masked_attention(q, k, v, mask=None):
    """The reference on one device: out and lse of q over all the keys at once (nh equal), as attend computes them."""
    global _LOG
    log, _LOG = _LOG, None
    try:
        return attend(q, k, v, mask)
    finally:
        _LOG = log


# --------------------------------------------------------------------------------------- what the ranks did


def _library_line(what: str, called: list[str]) -> str:
    return library_line(what, called, "the library's sequence-parallel code")


def _tensor(x, shape) -> torch.Tensor | None:
    """x if it is a tensor of this shape (detached), else None."""
    if isinstance(x, torch.Tensor) and list(x.shape) == list(shape):
        return x.detach().to(torch.float64).clone()
    return None


def _recording(known: dict) -> list:
    global _LOG, _KNOWN
    _LOG, _KNOWN = [], known
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


def _neighbours_wrong(calls, r: int) -> str:
    """What is wrong with whom rank r talked to ('' if only K/V to rank r+1 and from rank r-1, no collective)."""
    right, left = (r + 1) % P, (r - 1) % P
    sends = [c["peer"] for c in calls if c["op"] == "send"]
    recvs = [c["peer"] for c in calls if c["op"] in probe.P2P and c["op"] != "send"]
    if probe.library_collectives(calls):
        return f"called {sorted(set(probe.library_collectives(calls)))}"
    if not sends or set(sends) != {right}:
        return f"expected sends to rank {right} only, received sends to ranks {sends}"
    if not recvs or set(recvs) != {left}:
        return f"expected receives from rank {left} only, received receives from ranks {recvs}"
    return ""


def _sent(calls) -> list[torch.Tensor]:
    return [c["data"].to(torch.float64) for c in calls if c["op"] == "send" and "data" in c]


def _traffic_wrong(calls, sizes: list[int], matches, r: int, steps: int) -> str:
    """'' when rank r sent, at step s = 0..steps-1, rank (r-s)'s block: sizes[j] numbers (K then V, flattened) for
    which matches(piece, j) holds; else the first wrong step with what was expected and what came."""
    sent = _sent(calls)
    got = torch.cat(sent) if sent else torch.zeros(0, dtype=torch.float64)  # host: the grader's data
    expected = [sizes[(r - s) % P] for s in range(steps)]  # blocks may differ in size (uneven layouts)
    if got.numel() != sum(expected):
        return (
            f"expected {sum(expected) * 8:,} bytes in {steps} steps (K then V of rank r-s's block, nkv = {NKV} "
            f"heads), received {len(sent)} message(s), {got.numel() * 8:,} bytes in all"
        )
    offset = 0
    for s, size in enumerate(expected):
        piece, offset = got[offset : offset + size], offset + size
        if matches(piece, (r - s) % P):
            continue
        whose = [j for j in range(P) if sizes[j] == size and matches(piece, j)]
        what = f"rank {whose[0]}'s block" if whose else "none of the ranks' K/V blocks (K then V)"
        return f"step {s}: expected rank {(r - s) % P}'s K then V, received {what}"
    return ""


def _first(wrong: list[str]) -> str:
    """The first wrong item, and how many more."""
    return wrong[0] + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")


def _verdict(what: str, wrong: list[str]) -> str:
    return f"{what}: PASS" if not wrong else f"{what}: {_first(wrong)}: FAIL"


def _first_difference(got: torch.Tensor | None, ref: torch.Tensor) -> str:
    """Where got first differs from ref, with both values (for a FAIL line)."""
    if got is None:
        return "no tensor of the expected shape came back"
    bad = ~torch.isclose(got, ref, rtol=0, atol=1e-10, equal_nan=False) & ~(torch.isneginf(got) & torch.isneginf(ref))
    if not bad.any():
        return ""
    index = [int(i) for i in bad.nonzero()[0]]
    return f"first at {index}: expected {ref[tuple(index)].item():.6g}, received {got[tuple(index)].item():.6g}"


def _compare(what: str, got: torch.Tensor | None, ref: torch.Tensor, against: str) -> str:
    """compare(...).line, with the first wrong element (expected, received) when it fails. -inf (no key seen) must
    come back as -inf."""
    finite = lambda t: None if t is None else torch.where(torch.isneginf(t), -1e300, t)  # noqa: E731
    verdict = compare(what, finite(got) if got is not None else None, finite(ref), against=against)
    if verdict.passed or got is None:
        return verdict.line
    return dataclasses.replace(verdict, note=_first_difference(got, ref) or verdict.note).line


# ------------------------------------------------------------------------------------------- 1 · the merge


def collect_merge(merge) -> dict:
    results = {}
    with library_calls(LIBRARY) as called:
        for name, (cuts, scale, kind) in MERGE_CASES.items():
            q, k, v = merge_problem(1, scale)
            mask = merge_mask(kind)
            bounds = [0, *cuts, T_RING]
            out = lse = None
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                block_mask = None if mask is None else mask[:, lo:hi]
                o, block_lse = attend(q, k[..., lo:hi, :], v[..., lo:hi, :], block_mask)
                out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
            results[name] = {"out": torch.as_tensor(out).detach(), "lse": torch.as_tensor(lse).detach()}
    return {"cases": results, "library": list(called)}


def judge_merge(data) -> list[str]:
    lines = []
    for name, (_, scale, kind) in MERGE_CASES.items():
        q, k, v = merge_problem(1, scale)
        out, lse = masked_attention(q, k, v, merge_mask(kind))
        got = data["cases"][name]
        against = "attention over all the keys"
        lines.append(_compare(f"{name}: merged output", _tensor(got["out"], out.shape), out, against))
        lines.append(_compare(f"{name}: merged log-sum-exp", _tensor(got["lse"], lse.shape), lse, against))
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
    q, k, v = ring_problem(2)
    tiles = _recording({"q": [chunk(q, j, n) for j in range(P)], "k": [chunk(k, j, n) for j in range(P)]})
    since = time.perf_counter()
    with probe.recording() as calls, library_calls(LIBRARY) as called:
        out, lse, starts = ring_forward(
            chunk(q, r, n).clone(), chunk(k, r, n).clone(), chunk(v, r, n).clone(), ring_step
        )
    return {
        "out": _tensor(out, [B, NQ, n, HD]),
        "lse": _tensor(lse, [B, NQ, n]),
        "calls": calls,
        "tiles": list(tiles),
        "comm": _comm_events(since),
        "starts": starts + [time.perf_counter()],
        "library": list(called),
    }


def collect_ring(ring_step) -> dict:
    return {"ranks": list(parlab.launch(_run_ring, P, ring_step, **LAUNCH))}


def _step_overlap(tiles: list[dict], events: list[dict]) -> str:
    """'' when both transfers of a step were issued before its tile began and waited for after it ended."""
    kinds = sorted(e["kind"] for e in events)
    if not tiles:
        return "expected a tile computed with attend, received none"
    if set(kinds) != {"recv", "send"}:
        return f"expected a send and a receive through parlab.core.comm, received {kinds}"
    if any(e["start"] > tiles[0]["start"] for e in events):
        return "expected the transfers issued before the tile, received one issued after it began"
    if any(e["end"] < tiles[-1]["end"] for e in events):
        return "expected the transfers waited for after the tile, received one waited for before it was done"
    return ""


def _expected_heads() -> list[int]:
    return [h // GROUP for h in range(NQ)]


def judge_ring(data) -> list[str]:
    ranks, (q, k, v), n = data["ranks"], ring_problem(2), T_RING // P
    out = gqa_attention(q, k, v, causal=False)  # the lab model's attention on one device: [B, NQ, T, HD]
    _, lse = masked_attention(q, k.repeat_interleave(GROUP, 1), v.repeat_interleave(GROUP, 1))  # [B, NQ, T]
    against = "GQA attention over the whole sequence"
    nan = math.nan
    outs = [res["out"] if res["out"] is not None else torch.full((B, NQ, n, HD), nan) for res in ranks]  # host: judge
    lses = [res["lse"] if res["lse"] is not None else torch.full((B, NQ, n), nan) for res in ranks]  # host: judge
    lines = [
        _compare("output, the ranks' blocks in order", torch.cat(outs, 2), out, against),
        _compare("log-sum-exp, the ranks' blocks in order", torch.cat(lses, 2), lse, against),
    ]
    blocks = [torch.cat([chunk(k, j, n).flatten(), chunk(v, j, n).flatten()]) for j in range(P)]
    sizes = [block.numel() for block in blocks]
    talk, traffic, tiles, overlap = [], [], [], []
    for r in range(P):
        res = ranks[r]
        if wrong := _neighbours_wrong(res["calls"], r):
            talk.append(f"rank {r}: {wrong}")
        if wrong := _traffic_wrong(res["calls"], sizes, lambda piece, j: _close(piece, blocks[j]), r, P):
            traffic.append(f"rank {r}: {wrong}")
        starts = res["starts"]
        for s in range(P):
            lo, hi = starts[s], starts[s + 1]
            step_tiles = [t for t in res["tiles"] if lo <= t["start"] < hi]
            src = (r - s) % P
            if len(step_tiles) != 1:
                tiles.append(f"rank {r}: step {s}: expected one tile, received {len(step_tiles)}")
            elif (step_tiles[0]["q"], step_tiles[0]["k"]) != (r, src):
                t = step_tiles[0]
                tiles.append(
                    f"rank {r}: step {s}: expected rank {r}'s queries on rank {src}'s K/V, received "
                    + ("queries that are no rank's" if t["q"] < 0 else f"rank {t['q']}'s queries")
                    + " on "
                    + ("K/V heads of no one rank's block" if t["k"] < 0 else f"rank {t['k']}'s K/V")
                )
            elif step_tiles[0]["heads"] != _expected_heads():
                tiles.append(
                    f"rank {r}: step {s}: expected query heads 0..{NQ - 1} on K/V heads {_expected_heads()}, "
                    f"received K/V heads {step_tiles[0]['heads']}"
                )
            events = [e for e in res["comm"] if lo <= e["start"] < hi]
            if wrong := _step_overlap(step_tiles, events):
                overlap.append(f"rank {r}: step {s}: {wrong}")
    lines += [
        _verdict("every rank sent K/V only to rank r+1 and received only from rank r-1, no collective", talk),
        _verdict(f"what each rank sent at step s: rank r-s's K then V, its nkv = {NKV} heads only", traffic),
        _verdict(
            f"one tile per step: the rank's queries on rank r-s's K/V, query head h on K/V head h // {GROUP}", tiles
        ),
        _verdict("at every step both transfers were in flight while the tile computed", overlap),
        _library_line("ring_step", [name for res in ranks for name in res["library"]]),
    ]
    return lines


# ------------------------------------------------------------------------------------------- 3 · the prediction


def _pairs_theory(layout: str, T: int) -> int:
    """(query, key) pairs the causal mask leaves the busiest rank (the last one, in both layouts): c = T/P tokens."""
    c = T // P
    if layout == "contiguous":  # rank P-1: every key of the P-1 blocks before it, and a triangle of its own
        return (P - 1) * c * c + c * (c + 1) // 2
    # striped, rank P-1: its i-th token (position iP + P-1) sees every key up to itself: (i+1) P of them
    return sum((i + 1) * P for i in range(c))


def _bytes_theory(T: int) -> int:
    """Bytes one rank sends in one forward of the ring: P-1 steps of K and V with the nkv heads, float64."""
    return (P - 1) * 2 * B * NKV * (T // P) * HD * CFG.dtype_bytes


def work_theory() -> dict[str, float]:
    return {
        "pairs_contiguous": _pairs_theory("contiguous", T_WORK),
        "pairs_striped": _pairs_theory("striped", T_WORK),
        "bytes_sent": _bytes_theory(T_WORK),
    }


THEORY = {"work": work_theory}  # the numbers judge_work scores against (tests/test_lab_design.py hides them)


def _library_bytes() -> int:
    """Rank code: the bytes this rank hands to send in one forward of parlab's own ring attention, given K and V
    of the nkv heads (and as many query heads: the library's ring pairs them one to one)."""
    from parlab.schemes.sequence.ring_attention import ring_attention

    r, n = dist.get_rank(), T_WORK // P
    q, k, v = ring_problem(3, T_WORK)
    with probe.recording(keep_sent_data=False) as calls:
        ring_attention(chunk(q[:, :NKV], r, n), chunk(k, r, n), chunk(v, r, n), causal=True)
    return probe.total_bytes(calls, "send")


def _plain(value) -> float | str:
    """A prediction as a float when it is one number (a tensor or NumPy scalar too), else a short text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(value.item())
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return repr(value)[:40]


def collect_work(predicted: dict) -> dict:
    sent = parlab.launch(_library_bytes, P, **LAUNCH)
    return {"predicted": {str(k): _plain(v) for k, v in predicted.items()}, "bytes": [int(b) for b in sent]}


def _pairs_counted(layout: list[list[int]]) -> int:
    """The busiest rank's visible (query, key) pairs, counted on the T x T causal mask (query t sees keys 0..t)."""
    T = sum(len(tokens) for tokens in layout)
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # host: the reference on one device
    return max(int(causal[tokens].sum()) for tokens in layout)


def judge_work(data) -> list[str]:
    theory, predicted = THEORY["work"](), data["predicted"]
    measured = {
        "pairs_contiguous": _pairs_counted(contiguous(T_WORK)),
        "pairs_striped": _pairs_counted(striped(T_WORK)),
        "bytes_sent": max(data["bytes"]),
    }
    labels = {
        "pairs_contiguous": "pairs_contiguous (query-key pairs the busiest rank's queries see, contiguous)",
        "pairs_striped": "pairs_striped (query-key pairs the busiest rank's queries see, striped)",
        "bytes_sent": "bytes_sent (bytes a rank sends in one ring forward, GQA)",
    }
    lines = []
    for name, label in labels.items():
        lines += prediction_lines(label, predicted.get(name), theory[name], measured[name])
    return lines


# ------------------------------------------------------------------------------------------- 4 · the layer


def _heads(t: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T, n*hd] -> [B, n, T, hd]."""
    return t.view(B, T, -1, HD).transpose(1, 2)


def _layer_blocks(attn: GQAttention, layout: list[list[int]]) -> dict:
    """Per rank j, from one device's computation on the whole sequence: its queries and keys (rotated; nq and nkv
    heads) and its values (flattened), the blocks the checks recognise."""
    T = sum(len(tokens) for tokens in layout)
    x = layer_input(T).to(parlab.device())
    positions = torch.arange(T, device=parlab.device())
    with torch.no_grad():
        q = apply_rope(_heads(attn.q(x), T), positions, CFG.rope_base)  # [B, NQ, T, HD]
        k = apply_rope(_heads(attn.k(x), T), positions, CFG.rope_base)  # [B, NKV, T, HD]
        v = _heads(attn.v(x), T)
    pick = lambda t, j: t[:, :, layout[j]]  # noqa: E731
    return {
        "x": x,
        "q": [pick(q, j) for j in range(P)],
        "k": [pick(k, j) for j in range(P)],
        "v": [pick(v, j).flatten() for j in range(P)],
    }


def _run_layer(attention_layer) -> dict:
    r, results = dist.get_rank(), {}
    for name, layout in LAYOUTS.items():
        attn = layer_model().to(parlab.device())
        blocks = _layer_blocks(attn, layout)
        tiles = _recording({"q": blocks["q"], "k": blocks["k"]})
        mine = blocks["x"][:, layout[r]].clone()  # [B, n_r, H]: this rank's tokens, in the order layout[r]
        since = time.perf_counter()
        with probe.recording() as calls, library_calls(LIBRARY) as called, torch.no_grad():
            y = attention_layer(mine, attn, layout)
        results[name] = {
            "y": _tensor(y, [B, len(layout[r]), CFG.hidden]),
            "tiles": [dict(t) for t in tiles],
            "calls": calls,
            "comm": _comm_events(since),
            "library": list(called),
        }
    return results


def collect_layer(attention_layer) -> dict:
    return {"ranks": list(parlab.launch(_run_layer, P, attention_layer, **LAUNCH))}


def _expected_mask(layout: list[list[int]], r: int, src: int) -> torch.Tensor:
    mine, theirs = torch.tensor(layout[r]), torch.tensor(layout[src])  # host: the reference on one device
    return mine[:, None] >= theirs[None, :]  # query at position t sees the keys at positions <= t


def _tiles_wrong(tiles: list[dict], layout: list[list[int]], r: int) -> str:
    """'' when rank r computed one tile per block holding a key its queries may see (and none for the others),
    each with its own rotated queries, the keys of that block expanded h // GROUP, and the causal mask of the
    global positions; else the first thing wrong, expected and received."""
    expected = {src: _expected_mask(layout, r, src) for src in range(P)}
    expected = {src: _mask_text(mask, mask.shape) for src, mask in expected.items() if mask.any()}
    seen = set()
    for t in tiles:
        if t["q"] != r:
            return f"rank {r}: expected its queries rotated by its tokens' positions {layout[r]}, received " + (
                "no rank's rotated q (rotated by other positions?)" if t["q"] < 0 else f"rank {t['q']}'s"
            )
        if t["k"] < 0:
            return f"rank {r}: a tile whose keys are no rank's rotated K heads (rotated by other positions?)"
        if t["heads"] != _expected_heads():
            return (
                f"rank {r}: expected K/V heads {_expected_heads()} for query heads 0..{NQ - 1}, received {t['heads']}"
            )
        src = t["k"]
        if src not in expected:
            return f"rank {r}: a tile on rank {src}'s block, which holds no key its queries may see (skip it)"
        if src in seen:
            return f"rank {r}: the tile on rank {src}'s block computed twice"
        seen.add(src)
        if t["mask"] != expected[src]:
            return f"rank {r}: on rank {src}'s block expected the mask {expected[src]}, received {t['mask']}"
    missing = sorted(set(expected) - seen)
    return f"rank {r}: expected a tile on rank {missing[0]}'s block, received none" if missing else ""


def _overlap_wrong(res: dict, r: int) -> str:
    """'' when each of rank r's transfers was in flight while some tile computed (issued before, waited after)."""
    for i, e in enumerate(res["comm"]):
        if not any(e["start"] <= t["start"] and t["end"] <= e["end"] for t in res["tiles"]):
            peer = f"to rank {e['peer']}" if e["kind"] == "send" else f"from rank {e['peer']}"
            received = "never waited for" if e["end"] < 0 else "no tile between its issue and its wait"
            return (
                f"rank {r}: transfer {i + 1} of {len(res['comm'])} ({e['kind']} {peer}): expected in flight while "
                f"a tile computed, received {received}"
            )
    return ""


def judge_layer(data) -> list[str]:
    ranks, attn, lines = data["ranks"], layer_model(), []
    for name, layout in LAYOUTS.items():
        T = sum(len(tokens) for tokens in layout)
        x = layer_input(T)
        with torch.no_grad():
            reference = attn(x, torch.arange(T))  # host: the reference on one device; [B, T, H]
        got = torch.full_like(reference, math.nan)
        for r in range(P):
            y = ranks[r][name]["y"]
            if y is not None:
                got[:, layout[r]] = y
        lines.append(
            _compare(f"{name}: output, the ranks' tokens in sequence order", got, reference, "the layer on one device")
        )
        blocks = _layer_blocks(attn, layout)
        tiles = [w for r in range(P) if (w := _tiles_wrong(ranks[r][name]["tiles"], layout, r))]
        lines.append(
            _verdict(f"{name}: one tile per block with a visible key, its rotated queries, the causal mask", tiles)
        )
        # What travels: K then V of the block, nkv heads. Its K is judged by the tiles (rotated where it is used:
        # before the ring or on arrival, both right); its V names whose block it is.
        values = blocks["v"]
        sizes = [2 * v.numel() for v in values]
        holds = lambda piece, j, values=values: _close(piece[piece.numel() // 2 :], values[j])  # noqa: E731
        traffic = []
        for r in range(P):
            calls = ranks[r][name]["calls"]
            wrong = _neighbours_wrong(calls, r) or _traffic_wrong(calls, sizes, holds, r, P - 1)
            traffic += [f"rank {r}: {wrong}"] if wrong else []
        lines.append(_verdict(f"{name}: K/V passed on P-1 times to rank r+1, rank r-s's K then V at step s", traffic))
        if name.startswith("striped"):  # a tile at every step: every transfer can hide behind one
            overlap = [w for r in range(P) if (w := _overlap_wrong(ranks[r][name], r))]
            lines.append(_verdict(f"{name}: every transfer in flight while a tile computed", overlap))
    called = [f for res in ranks for layout in res.values() for f in layout["library"]]
    lines.append(_library_line("attention_layer", called))
    return lines
