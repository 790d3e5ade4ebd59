"""Lab 04's checks: the student's online-softmax merge, then one step of ring attention on live ranks.

Beyond "the output is attention over the whole sequence", the merge is checked with scores so large that
exp(lse) overflows float64 (a merge must work with differences of log-sum-exps), and the ring step is checked from
what the ranks handed to torch.distributed (parlab.grading.probe): K/V blocks passed only to the right neighbour,
the blocks the ring holds at each step, no library collective.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import parlab
from parlab.check import check_equal, compare
from parlab.grading import probe, run_check
from parlab.ring_attention import attend_tile

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a send nobody receives) stops after 60 s and names the ranks
P, B, NH, T, HS = 4, 1, 2, 16, 4  # ranks; q, k, v: [B, NH, T, HS], rank r holds tokens [r*T/P, (r+1)*T/P)
MERGE_CASES = {  # name: (where the keys are cut into blocks, a factor on q: large scores make exp(lse) overflow)
    "two halves": ((8,), 1.0),
    "uneven blocks 3 + 13": ((3,), 1.0),
    "three blocks merged left to right": ((5, 11), 1.0),
    "scores in the thousands (exp(lse) overflows)": ((8,), 2000.0),
}

STRUCTURAL = {
    "merge": "the merged output and log-sum-exp equal attention over all the keys for two, uneven and three blocks, "
    "and for scores in the thousands, where exp(lse) overflows float64 (only differences of lse may be "
    "exponentiated)",
    "ring": "P steps per rank: K/V sent only to the right neighbour and received only from the left, no library "
    "collective; the data sent at step s is the K/V block of rank r-s (so the ring really passes the blocks on); "
    "the output and log-sum-exp equal attention over the whole sequence",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def full_problem(seed: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v: [B, NH, T, HS] float64, drawn from a seed (q multiplied by `scale`)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, NH, T, HS, generator=gen, dtype=torch.float64) for _ in range(3))
    return q * scale, k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q on one block of keys and values (no mask): (out [.., Tq, HS] normalised over these keys,
    lse [.., Tq] = log sum exp of the scores q k^T / sqrt(HS) over these keys)."""
    return attend_tile(q, k, v, "full")


def full_attention(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: out and lse over all the keys at once, on one device."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, NH, Tq, Tk]
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def ring_forward(q, k, v, ring_step):
    """Rank code: P calls of the student's ring_step, starting from this rank's own K/V block and no result."""
    out = lse = None
    for _ in range(dist.get_world_size()):
        out, lse, k, v = ring_step(q, k, v, out, lse)
    return out, lse, k, v


# ------------------------------------------------------------------------------------------------ the checks


def collect_merge(merge) -> dict:
    results = {}
    for name, (cuts, scale) in MERGE_CASES.items():
        q, k, v = full_problem(1, scale)
        bounds = [0, *cuts, T]
        out = lse = None
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            o, block_lse = attend(q, k[..., lo:hi, :], v[..., lo:hi, :])
            out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
        results[name] = {"out": torch.as_tensor(out).detach(), "lse": torch.as_tensor(lse).detach()}
    return {"cases": results}


def judge_merge(data) -> list[str]:
    lines = []
    for name, (_, scale) in MERGE_CASES.items():
        out, lse = full_attention(*full_problem(1, scale))
        got = data["cases"][name]
        against = "attention over all the keys"
        lines.append(compare(f"{name}: merged output", got["out"], out, show=False, against=against).line)
        lines.append(compare(f"{name}: merged log-sum-exp", got["lse"], lse, show=False, against=against).line)
    return lines


def _run_ring(ring_step) -> dict:
    r, n = dist.get_rank(), T // P
    q, k, v = (t[..., r * n : (r + 1) * n, :].clone() for t in full_problem(2))  # my block: [B, NH, T/P, HS]
    with probe.recording() as calls:
        out, lse, k_end, v_end = ring_forward(q, k, v, ring_step)
    return {"out": out, "lse": lse, "k_end": k_end, "v_end": v_end, "calls": calls}


def collect_ring(ring_step) -> dict:
    return {"ranks": list(parlab.launch(_run_ring, P, ring_step, **LAUNCH))}


def judge_ring(data) -> list[str]:
    ranks, (q, k, v), n = data["ranks"], full_problem(2), T // P
    out, lse = full_attention(q, k, v)
    against = "attention over the whole sequence"
    lines = [
        compare("output, the ranks' blocks in order", torch.cat([res["out"] for res in ranks], 2), out, show=False,
                against=against).line,
        compare("log-sum-exp, the ranks' blocks in order", torch.cat([res["lse"] for res in ranks], 2), lse,
                show=False, against=against).line,
    ]  # fmt: skip
    blocks = [torch.cat([k[..., j * n : (j + 1) * n, :].flatten(), v[..., j * n : (j + 1) * n, :].flatten()])
              for j in range(P)]  # fmt: skip
    for r in range(P):
        calls, right, left = ranks[r]["calls"], (r + 1) % P, (r - 1) % P
        sends = [c for c in calls if c["op"] == "send"]
        recvs = [c for c in calls if c["op"] in probe.P2P and c["op"] != "send"]
        wrong = []
        if probe.library_collectives(calls):
            wrong.append(f"library collective(s) {sorted(set(probe.library_collectives(calls)))}")
        if not sends or {c["peer"] for c in sends} != {right}:
            wrong.append(f"sent to ranks {[c['peer'] for c in sends]}")
        if not recvs or {c["peer"] for c in recvs} != {left}:
            wrong.append(f"received from ranks {[c['peer'] for c in recvs]}")
        what = f"rank {r}: K/V sent only to rank {right}, received only from rank {left}, no collective"
        lines.append(f"{what}: PASS" if not wrong else f"{what}: found {'; '.join(wrong)}: FAIL")
        sent = [c["data"] for c in sends if "data" in c]
        sent = torch.cat(sent) if sent else torch.zeros(0, dtype=torch.float64)
        expected = torch.cat([blocks[(r - s) % P] for s in range(P)])  # step s: the block of rank r-s
        lines.append(
            compare(f"rank {r}: what it sent, step by step (K then V)", sent, expected, show=False,
                    against="the ring's blocks").line
        )  # fmt: skip
        lines.append(check_equal(f"rank {r}: bytes sent (P K/V blocks)", probe.total_bytes(calls, "send"),
                                 P * 2 * B * NH * n * HS * 8, show=False).line)  # fmt: skip
    return lines
