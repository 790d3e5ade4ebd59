"""Lesson 00 (notebooks/00_collectives.ipynb): the collectives chunk by chunk, and the ring all-reduce's figures.

The ring all-reduce itself is in parlab/collectives.py; this module runs the demos and draws what each rank holds:

    six collectives      `show_collective`, `draw_collective`: who holds which chunk before and after
    the ring, stepped    `ring_demo_rank_fn`, `draw_ring_step`: the chunks in flight at each of the 2(P-1) steps

Rank code here (`*_rank_fn`) imports torch only; plotly is imported inside each figure function.
"""

from __future__ import annotations

import torch

from parlab import comm
from parlab.collectives import ring_all_reduce, ring_step_sends
from parlab.launch import Results, launch

COLLECTIVES = ("broadcast", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")


# ------------------------------------------------------------------------------ the collectives, chunk by chunk


def initial_chunks(rank: int, world_size: int) -> torch.Tensor:
    """What rank r holds before a collective: P chunks with values 100 r + c, so a value names its origin."""
    return torch.tensor([100.0 * rank + c for c in range(world_size)], dtype=torch.float64)


def collective_rank_fn(kind: str) -> dict:
    """Run one collective on P chunks per rank; return the chunks before and after. A chunk is one number."""
    P, r = comm.group_size(), comm.group_rank()
    before = initial_chunks(r, P)
    x = before.clone()
    if kind == "broadcast":
        comm.broadcast(x, src=0)
        after = x
    elif kind == "all_reduce":
        comm.all_reduce(x)
        after = x
    elif kind == "reduce_scatter":
        mine = torch.zeros(1, dtype=x.dtype)
        comm.reduce_scatter_tensor(mine, x)  # rank r gets the sum over ranks of chunk r
        after = torch.full((P,), float("nan"), dtype=x.dtype)
        after[r] = mine
    elif kind == "all_gather":
        mine = x[r : r + 1].clone()  # each rank contributes its own chunk r
        after = torch.empty(P, dtype=x.dtype)
        comm.all_gather_into_tensor(after, mine)
    elif kind == "all_to_all":
        after = torch.empty(P, dtype=x.dtype)
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
    from parlab.plots import FULL_SUM

    return FULL_SUM if kind in ("all_reduce", "reduce_scatter") else int(value // 100)


def draw_collective(kind: str, results: Results):
    """Before/after shard diagram of `show_collective(kind)`: which rank holds which chunk, coloured by origin."""
    from parlab import plots

    P = len(results)

    def panel(name, which, kind_for_owner):
        rows = [results[r][which].tolist() for r in range(P)]
        texts = [[None if v != v else f"{v:g}" for v in row] for row in rows]
        owners = [[0 if v != v else _owner_of(v, kind_for_owner) for v in row] for row in rows]
        return name, texts, owners

    title = f"{kind.replace('_', '-')} on {P} ranks (chunk value 100 x origin rank + chunk index)"
    return plots.chunk_grid([panel("before", "before", "none"), panel("after", "after", kind)], title)


# -------------------------------------------------------------------------------------- the ring, step by step


def ring_demo_rank_fn() -> list:
    """Rank code for the picture: rank r contributes 2^r in every chunk, so a sum's bits name its contributors."""
    P, r = comm.group_size(), comm.group_rank()
    history: list = []
    ring_all_reduce(torch.full((P,), 2.0**r, dtype=torch.float64), history)
    return [torch.cat(snapshot) for snapshot in history]  # 2(P-1) + 1 snapshots, each [P] (one value a chunk)


def draw_ring_step(histories: list, step: int):
    """The ring all-reduce after `step` of its 2(P-1) steps: each cell names the ranks summed into it."""
    from parlab import plots

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
