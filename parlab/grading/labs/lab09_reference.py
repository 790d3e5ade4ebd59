"""Lab 09's reference: the inputs every rank draws (seeded), the experts, and what one device computes of them.

The checks of parlab/grading/labs/lab09_expert_parallel.py build every rank's inputs and judge every answer with the
functions here. Called from an answer they would stand in for work the lab asks for (a rank reading the other ranks'
rows instead of exchanging counts, a dispatch copying the reference's order), so this file is on the lab's
`LIBRARY`: an answer that calls into it is a FAIL line naming the call.

P = 4 ranks, E = 8 experts placed round-robin (expert e on rank e % P), H = 6, float64. The experts are the lab
model's MLP (parlab/core/lab_model.py's SwiGLU, no biases), width F = 8.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

P, E, H, FFN = 4, 8, 6, 8  # ranks, experts, hidden size, each expert's SwiGLU width
PER = E // P  # experts per rank: rank r holds r, r + P, r + 2P, ... (round-robin)
K = 2  # experts per token
TOKENS = 10  # tokens per rank in the combine and capacity checks
# The dispatch check's routing: the expert of each row of each rank. The pairs with rows (0 -> 1, 0 -> 3, 2 -> 0,
# 2 -> 3, 3 -> 0, 3 -> 1) need 2 rounds at the least (no rank sends to or receives from more than two others); the
# shifts d = s + k mod P, skipping the empty ones, need 3 chained rounds, and so does a greedy colouring in (s, d)
# order. Rank 1 sends nothing, rank 2 receives nothing, experts 3 and 6 get no rows.
DISPATCH_EXPERTS = (
    (1, 7, 0, 5, 4),
    (),
    (0, 7, 2, 4, 7, 0, 2),
    (5, 0, 7, 4, 1, 7, 0, 5, 4),
)
ROWS = tuple(len(e) for e in DISPATCH_EXPERTS)  # rows per rank in the dispatch check
ZERO_GATE = (2, 3, 1)  # (rank, token, choice): a chosen expert whose gate is exactly 0 in the combine check
CAPACITY = 8  # slots per expert over the whole group in the capacity check (first choices first)
CAPACITY_NUMBERS = 6 * E  # the most int64 numbers a rank may receive, and send, to make its capacity mask
# The prediction's routing, on PREDICT_P ranks with PREDICT_E experts placed round-robin, given to the student in
# words (lab 09, part 3), here as ROUTING[s]: (e1, e2, n), n tokens of rank s chose experts e1 and e2 (top-2):
# every rank s: tokens that chose experts 2s and 2s + 1; ranks s >= 48: also tokens that chose experts 5 and 69 (a
# hot rank); ranks s that are multiples of 4: also tokens that chose experts s and s + 64 (both on rank s itself).
PREDICT_P, PREDICT_E = 64, 128
ROUTING = [
    [(2 * s, 2 * s + 1, 2)] + [(5, 69, 1)] * (s >= 48) + [(s, s + 64, 1)] * (s % 4 == 0) for s in range(PREDICT_P)
]


# ------------------------------------------------------------------------------------------------ inputs


def swiglu(w: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """One expert, the lab model's MLP: down(silu(gate rows) * up rows). rows [n, H]; w: gate, up [F, H], down
    [H, F] -> [n, H]."""
    return (F.silu(rows @ w["gate"].T) * (rows @ w["up"].T)) @ w["down"].T


def owner(e: int) -> int:
    """The rank that holds expert e (round-robin)."""
    return e % P


def experts_of(rank: int) -> list[int]:
    """The global ids of the experts `rank` holds, in its local order."""
    return [e for e in range(E) if owner(e) == rank]


def expert_weights() -> dict[str, torch.Tensor]:
    """Every expert's weights: gate, up [E, F, H], down [E, H, F] (rank r holds those of its experts only)."""
    gen = torch.Generator().manual_seed(9)
    shapes = {"gate": (E, FFN, H), "up": (E, FFN, H), "down": (E, H, FFN)}
    weights = {}
    for name, shape in shapes.items():  # each rank copies its experts' weights onto its device
        weights[name] = torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[-1])  # host: seeded
    return weights


def dispatch_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows x [n, H] and the expert of each row [n] (skewed: experts 3 and 6 get none)."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(ROWS[rank], H, generator=gen, dtype=torch.float64)  # host: the seeded draw
    return x, torch.tensor(DISPATCH_EXPERTS[rank], dtype=torch.long)  # host: the routing of the table above


def layer_inputs(rank: int, tokens: int = TOKENS):
    """Rank r's tokens x [N, H], their K experts [N, K] (distinct, skewed: experts e and e + 4, on the same rank,
    often together) and gates [N, K] (rows sum to 1)."""
    gen = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(tokens, H, generator=gen, dtype=torch.float64)  # host: the seeded draw
    probs = torch.tensor([7.0, 3, 1, 0.2, 6, 2, 0.5, 1.5], dtype=torch.float64)  # host: the router's skew
    chosen = torch.stack([torch.multinomial(probs, K, generator=gen) for _ in range(tokens)])
    gates = torch.rand(tokens, K, generator=gen, dtype=torch.float64) + 0.1  # host: the seeded draw
    gates = gates / gates.sum(dim=1, keepdim=True)
    if rank == ZERO_GATE[0]:  # a router can hand a chosen expert a gate of exactly 0: it is still chosen
        gates[ZERO_GATE[1], ZERO_GATE[2]] = 0.0
    return x, chosen, gates


def upstream(rank: int, rows: int) -> torch.Tensor:
    """A fixed weight [rows, H] per output row: backward of (out * upstream).sum()."""
    gen = torch.Generator().manual_seed(300 + rank)
    return torch.randn(rows, H, generator=gen, dtype=torch.float64)  # host: the seeded draw


# ------------------------------------------------------------------------------------------------ one device


def shuffle_reference() -> list[dict]:
    """Per destination rank d: the rows it receives (by source, then its experts in local order, each expert's rows
    in their order), the counts [P, PER], where each source row lands (for the gradient of x), and which source row
    each received row is ("rank s's row i (expert e)")."""
    inputs = [dispatch_inputs(r) for r in range(P)]
    out = []
    for d in range(P):
        rows, counts, land, names = [], torch.zeros(P, PER, dtype=torch.long), {}, []  # host: one device
        for s, (x, chosen) in enumerate(inputs):
            for j, e in enumerate(experts_of(d)):
                idx = (chosen == e).nonzero().flatten().tolist()
                counts[s, j] = len(idx)
                for i in idx:
                    land[(s, i)] = len(rows)
                    rows.append(x[i])
                    names.append(f"rank {s}'s row {i} (expert {e})")
        out.append(
            {
                "rows": torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.float64),  # host: one device
                "counts": counts,
                "land": land,
                "names": names,
            }
        )
    return out


def layer_reference(tokens: int = TOKENS, capacity: int | None = None):
    """One device: every rank's y, the gradients, and the kept mask [N, K] per rank. The slots of an expert go to
    the first choices before any second choice (GShard's priority), each choice's in rank order, then token order."""
    W = {name: w.requires_grad_() for name, w in expert_weights().items()}
    inputs, results = [layer_inputs(r, tokens) for r in range(P)], []
    keeps = [torch.ones_like(chosen, dtype=torch.bool) for _, chosen, _ in inputs]
    if capacity is not None:
        used = [0] * E
        for j in range(K):
            for r in range(P):
                for i, e in enumerate(inputs[r][1][:, j].tolist()):
                    keeps[r][i, j] = used[e] < capacity
                    used[e] += 1
    for r in range(P):
        x, chosen, gates = inputs[r]
        x.requires_grad_(), gates.requires_grad_()
        keep = keeps[r]
        y = torch.zeros_like(x)
        for i in range(tokens):
            for j in range(K):
                if keep[i, j]:
                    e = int(chosen[i, j])
                    out = swiglu({name: w[e] for name, w in W.items()}, x[i : i + 1])
                    y = y.index_add(0, torch.tensor([i]), gates[i, j] * out)  # host: the reference on one device
        (y * upstream(r, tokens)).sum().backward()
        results.append({"y": y.detach(), "dx": x.grad, "dgates": gates.grad, "keep": keep, "chosen": chosen})
    for r in range(P):
        results[r]["dW"] = {str(e): {name: w.grad[e] for name, w in W.items()} for e in experts_of(r)}
    return results


def pair_matrix(ref: list[dict]) -> list[list[int]]:
    """M[s][d]: the (token, destination) pairs of rank s for destination d: its tokens with at least one kept
    assignment to an expert on rank d (one row each, however many of d's experts the token chose)."""
    return [[int((((x["chosen"] % P) == d) & x["keep"]).any(dim=1).sum()) for d in range(P)] for x in ref]


def degree(pattern: list[list[bool]]) -> int:
    """The most messages one rank sends or receives in `pattern` (pattern[s][d]: s sends d one message): the fewest
    rounds of one send and one receive per rank (a bipartite graph's edges coloured with its maximum degree
    colours, Koenig)."""
    n = len(pattern)
    out = [sum(bool(pattern[s][d]) for d in range(n) if d != s) for s in range(n)]
    into = [sum(bool(pattern[s][d]) for s in range(n) if s != d) for d in range(n)]
    return max(out + into + [0])


def routing_pattern(routing, ranks: int) -> list[list[bool]]:
    """pattern[s][d]: rank s sends rank d at least one token row in the part-2 layer's forward (round-robin)."""
    return [
        [d != s and any(d in (a % ranks, b % ranks) for a, b, _ in routing[s]) for d in range(ranks)]
        for s in range(ranks)
    ]


def rounds_theory() -> dict:
    """The prediction: on ROUTING (PREDICT_P ranks, round-robin), the rounds of the part-2 layer's forward token
    rows in the fewest-rounds schedule, and in the shifted schedule (round k: s sends to s + k mod P) that skips
    the shifts in which no rank has a message."""
    n = PREDICT_P
    pattern = routing_pattern(ROUTING, n)
    shifts = sum(any(pattern[s][(s + k) % n] for s in range(n)) for k in range(1, n))
    return {"rounds_fewest": degree(pattern), "rounds_shifted": shifts}


THEORY = {"rounds": rounds_theory}
