"""Lesson 00 (notebooks/00_collectives.ipynb): the collectives chunk by chunk, and the ring all-reduce's figures.

The ring all-reduce itself is in parlab/schemes/collectives.py; this module runs the demos and draws what each rank
holds:

    six collectives      `show_collective`, `draw_collective`: who holds which chunk before and after
    two byte counts      `wire_bytes`, `bytes_table`: the payload handed to a collective, the bytes on the wire
    the ring, stepped    `ring_demo_rank_fn`, `draw_ring_step`: the chunks in flight at each of the 2(P-1) steps

Rank code here (`*_rank_fn`) imports torch only; plotly is imported inside each figure function.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from parlab.core import comm
from parlab.runtime.errors import Results
from parlab.runtime.launcher import launch
from parlab.schemes.collectives import ring_all_reduce, ring_step_sends

COLLECTIVES = ("broadcast", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")


# ------------------------------------------------------------------------------ the collectives, chunk by chunk


def initial_chunks(rank: int, world_size: int, device=None) -> torch.Tensor:
    """What rank r holds before a collective: P chunks with values 100 r + c, so a value names its origin."""
    return torch.tensor([100.0 * rank + c for c in range(world_size)], dtype=torch.float64, device=device)


def collective_rank_fn(kind: str) -> dict:
    """Run one collective on P chunks per rank; return the chunks before and after. A chunk is one number."""
    P, r = comm.group_size(), comm.group_rank()
    before = initial_chunks(r, P, comm.device())  # on this rank's device: its GPU under NCCL
    x = before.clone()
    if kind == "broadcast":
        comm.broadcast(x, src=0)
        after = x
    elif kind == "all_reduce":
        comm.all_reduce(x)
        after = x
    elif kind == "reduce_scatter":
        mine = torch.zeros(1, dtype=x.dtype, device=x.device)
        comm.reduce_scatter_tensor(mine, x)  # rank r gets the sum over ranks of chunk r
        after = torch.full((P,), float("nan"), dtype=x.dtype, device=x.device)
        after[r] = mine
    elif kind == "all_gather":
        mine = x[r : r + 1].clone()  # each rank contributes its own chunk r
        after = torch.empty(P, dtype=x.dtype, device=x.device)
        comm.all_gather_into_tensor(after, mine)
    elif kind == "all_to_all":
        after = torch.empty(P, dtype=x.dtype, device=x.device)
        comm.all_to_all_single(after, x)  # chunk c of rank r goes to rank c, as its chunk r
    elif kind == "send_recv":
        after = x.clone()  # rank r sends its whole row to rank r+1 (ring shift), receives from r-1
        works = [comm.isend(x, (r + 1) % P), comm.irecv(after, (r - 1) % P)]
        comm.wait_all(works)
    else:
        raise ValueError(f"unknown collective {kind!r}; one of {COLLECTIVES}")
    return {"before": before, "after": after}


def show_collective(kind: str, world_size: int = 4) -> Results:
    """Run one collective on `world_size` ranks; results[r] = {"before", "after"} chunks of rank r."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; one of {COLLECTIVES}")
    return launch(collective_rank_fn, world_size, kind, echo=False)


def _owner_of(value: float, kind: str) -> int:
    from parlab.views.plots import FULL_SUM

    return FULL_SUM if kind in ("all_reduce", "reduce_scatter") else int(value // 100)


def draw_collective(kind: str, results: Results):
    """Before/after shard diagram of `show_collective(kind)`: which rank holds which chunk, coloured by origin."""
    from parlab.views import plots

    P = len(results)

    def panel(name, which, kind_for_owner):
        rows = [results[r][which].tolist() for r in range(P)]
        texts = [[None if v != v else f"{v:g}" for v in row] for row in rows]
        owners = [[0 if v != v else _owner_of(v, kind_for_owner) for v in row] for row in rows]
        return name, texts, owners

    title = f"{kind.replace('_', '-')} on {P} ranks (chunk value 100 x origin rank + chunk index)"
    return plots.chunk_grid([panel("before", "before", "none"), panel("after", "after", kind)], title)


# ---------------------------------------------------------------------------------- two ways to count bytes

# Every communication byte figure in the lessons is one of two, and says which (lesson 00, "Two ways to count
# bytes"):
#   PAYLOAD  the bytes of the tensors a rank hands to a collective or to send/recv: what parlab.core.comm counts.
#            all-reduce, broadcast, all-to-all: the tensor passed; all-gather: the rank's own contribution;
#            reduce-scatter: the whole input it reduces; send / recv: the tensor sent / received.
#   WIRE     the bytes a rank sends on its link ("sent", "on the wire"); they depend on the algorithm the backend
#            picks. With ring algorithms on P ranks they follow from the payload, per rank:
RING_WIRE = {
    "all_reduce": "2(P-1)/P x payload",  # a reduce-scatter, then an all-gather: 2(P-1) chunks of payload/P
    "reduce_scatter": "(P-1)/P x payload",  # the payload is the whole input: P-1 of its P chunks leave the rank
    "all_gather": "(P-1) x payload",  # the payload is the rank's own chunk: it sends P-1 chunks of that size
    "all_to_all": "(P-1)/P x payload",  # the chunk addressed to itself stays
    "send": "payload",  # point to point: the payload is what goes on the wire
}
_RING_FACTOR = {
    "all_reduce": lambda P: Fraction(2 * (P - 1), P),
    "reduce_scatter": lambda P: Fraction(P - 1, P),
    "all_gather": lambda P: Fraction(P - 1),
    "all_to_all": lambda P: Fraction(P - 1, P),
    "send": lambda P: Fraction(1),
}


def wire_bytes(kind: str, payload: float, world_size: int) -> int | float:
    """Bytes one rank sends on its link for a collective whose payload (parlab.core.comm's count) is `payload` bytes,
    with the ring algorithms of RING_WIRE. A broadcast or reduce has no one figure per rank (a tree or a chain)."""
    if kind not in _RING_FACTOR:
        raise ValueError(f"no ring formula for {kind!r}; one of {list(RING_WIRE)}")
    sent = _RING_FACTOR[kind](world_size) * Fraction(payload)
    return int(sent) if sent.denominator == 1 else float(sent)


def bytes_table(world_size: int = 4) -> list[str]:
    """Both counts for each collective of `show_collective`: the payload each rank handed over (measured by
    parlab.core.comm, from the tensors passed) and the bytes a ring algorithm sends per rank for it (theory)."""
    P = world_size

    def same(values: list[int]) -> str:
        return f"{values[0]} (every rank)" if len(set(values)) == 1 else str(values)

    lines = [f"{'collective':15s} {'payload per rank (measured)':28s} sent per rank, on the wire (ring algorithms)"]
    for kind in COLLECTIVES:
        measured = show_collective(kind, P).trace.bytes_per_rank()
        if kind == "send_recv":
            payload = same(measured["send"])
            wire = f"the payload itself = {wire_bytes('send', measured['send'][0], P)} (and as much received)"
        elif kind == "broadcast":
            payload = same(measured[kind])
            chain = " -> ".join(str(r) for r in range(P))
            wire = f"no one figure: a chain {chain} sends {measured[kind][0]} from each rank but the last"
        else:
            payload = same(measured[kind])
            wire = f"{RING_WIRE[kind]} = {wire_bytes(kind, measured[kind][0], P)}"
        lines.append(f"{kind:15s} {payload:28s} {wire}")
    return lines


# -------------------------------------------------------------------------------------- the ring, step by step


def ring_demo_rank_fn() -> list:
    """Rank code for the picture: rank r contributes 2^r in every chunk, so a sum's bits name its contributors."""
    P, r = comm.group_size(), comm.group_rank()
    history: list = []
    ring_all_reduce(torch.full((P,), 2.0**r, dtype=torch.float64, device=comm.device()), history)
    return [torch.cat(snapshot) for snapshot in history]  # 2(P-1) + 1 snapshots, each [P] (one value a chunk)


def draw_ring_step(histories: list, step: int):
    """The ring all-reduce after `step` of its 2(P-1) steps: each cell names the ranks summed into it."""
    from parlab.views import plots

    P = len(histories)
    texts, owners = [], []
    for r in range(P):
        row_text, row_owner = [], []
        for value in histories[r][step].tolist():
            contributors = [q for q in range(P) if int(value) >> q & 1]
            row_text.append("+".join(map(str, contributors)))
            if len(contributors) == 1:
                row_owner.append(contributors[0])
            else:
                row_owner.append(plots.FULL_SUM if len(contributors) == P else plots.PARTIAL_SUM)
        texts.append(row_text)
        owners.append(row_owner)
    if step == 0:
        phase = "start: rank r holds only its own data"
    elif step <= P - 1:
        phase = f"reduce-scatter step {step} of {P - 1}"
    else:
        phase = f"all-gather step {step - (P - 1)} of {P - 1}"
    arrows = ring_step_sends(P, step)
    subtitle = "arrows: the chunk each rank sent to its right neighbour" if arrows else "each cell: ranks summed in it"
    return plots.chunk_grid([(subtitle, texts, owners)], f"Ring all-reduce on {P} ranks: {phase}", arrows)
