"""Collectives, seen from the ranks: who holds which chunk before and after, and a ring all-reduce by hand.

Lesson 00 runs `show_collective` for each of broadcast, all-reduce, reduce-scatter, all-gather, all-to-all and
send/recv, and then `ring_all_reduce`: an all-reduce written with nothing but send and recv.

The ring all-reduce (Patarasuk & Yuan, 2009) on P ranks splits the tensor into P chunks and runs two phases of
P-1 steps each. At every step each rank sends one chunk to its right neighbour and receives one from its left:

    reduce-scatter phase: step s, rank r sends chunk (r - s) mod P and adds the chunk (r - s - 1) mod P it receives;
                          after P-1 steps rank r holds the full sum of chunk (r + 1) mod P.
    all-gather phase:     step s, rank r sends chunk (r + 1 - s) mod P and overwrites chunk (r - s) mod P with the
                          finished chunk it receives; after P-1 steps every rank holds every summed chunk.

Each rank sends 2(P-1) chunks of N/P elements: 2(P-1)/P x N in total, whatever P is. That is why a ring
all-reduce is bandwidth-optimal, and the figure lesson 00 measures.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parlab import comm
from parlab.check import check_equal, compare
from parlab.launch import Results
from parlab.schemes import Scheme, launch_scheme

COLLECTIVES = ("broadcast", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")


# ----------------------------------------------------------------------------------------- the ring all-reduce


def ring_all_reduce(tensor: torch.Tensor, history: list | None = None) -> torch.Tensor:
    """Sum `tensor` over all ranks with send/recv only; returns the sum (every rank gets all of it).

    tensor: any shape, the same on every rank. history: if a list, it receives a snapshot of this rank's chunks
    (a list of P tensors) before the first step and after each of the 2(P-1) steps, for drawing.
    """
    P, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % P, (r - 1) % P
    # P chunks along the flattened tensor; tensor_split also handles N not divisible by P (chunks differ by 1).
    chunks = [c.clone() for c in tensor.flatten().tensor_split(P)]
    if history is not None:
        history.append([c.clone() for c in chunks])

    def exchange(send_index: int, recv_index: int, step: str) -> torch.Tensor:
        incoming = torch.empty_like(chunks[recv_index])
        # Post both at once: if every rank first did a blocking send, no rank would be receiving.
        works = [comm.isend(chunks[send_index], right, label=step), comm.irecv(incoming, left, label=step)]
        comm.wait_all(works)
        return incoming

    for s in range(P - 1):  # reduce-scatter phase
        send_index, recv_index = (r - s) % P, (r - s - 1) % P
        chunks[recv_index] += exchange(send_index, recv_index, f"reduce-scatter step {s}")
        if history is not None:
            history.append([c.clone() for c in chunks])

    for s in range(P - 1):  # all-gather phase: pass the finished chunks around the ring
        send_index, recv_index = (r + 1 - s) % P, (r - s) % P
        chunks[recv_index] = exchange(send_index, recv_index, f"all-gather step {s}")
        if history is not None:
            history.append([c.clone() for c in chunks])

    return torch.cat(chunks).view_as(tensor)


def ring_theory_bytes(numel: int, element_size: int, world_size: int) -> list[int]:
    """Bytes each rank sends in a ring all-reduce, in rank order: 2(P-1) chunks, i.e. 2(P-1)/P x N bytes
    when P divides N (otherwise chunks differ by one element and so do the ranks' totals)."""
    P = world_size
    chunk_sizes = [len(c) for c in torch.arange(numel).tensor_split(P)]
    # Over the 2(P-1) steps rank r sends chunks (r - s) for s < P-1, then (r + 1 - s): each chunk but one, twice.
    per_rank = [
        sum(chunk_sizes[(r - s) % P] for s in range(P - 1)) + sum(chunk_sizes[(r + 1 - s) % P] for s in range(P - 1))
        for r in range(P)
    ]
    return [n * element_size for n in per_rank]


def ring_rank_fn(numel: int, dtype: str = "float64", seed: int = 0, keep_history: bool = False) -> dict:
    """Rank code for the check: each rank draws its own data, sums it with the ring and with dist.all_reduce."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=gen, dtype=getattr(torch, dtype))
    history = [] if keep_history else None
    ring = ring_all_reduce(x, history)
    reference = x.clone()
    dist.all_reduce(reference)  # untraced on purpose: the trace shows only what the ring sent
    return {"input": x, "ring": ring, "all_reduce": reference, "history": history}


# ------------------------------------------------------------------------------ the collectives, chunk by chunk


def initial_chunks(rank: int, world_size: int) -> torch.Tensor:
    """What rank r holds before a collective: P chunks with values 100 r + c, so a value names its origin."""
    return torch.tensor([100.0 * rank + c for c in range(world_size)], dtype=torch.float64)


def collective_rank_fn(kind: str) -> dict:
    """Run one collective on P chunks per rank; return the chunks before and after. A chunk is one number."""
    P, r = dist.get_world_size(), dist.get_rank()
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
    return _launch(collective_rank_fn, world_size, kind)


def _launch(fn, world_size, *args, **kwargs) -> Results:
    from parlab.launch import launch

    return launch(fn, world_size, *args, echo=False, **kwargs)


def run_ring(world_size: int = 4, numel: int = 1024, dtype: str = "float64", seed: int = 0, keep_history=False):
    """Run the ring all-reduce on live ranks; returns (results, report) like `python -m parlab run collectives`."""
    return launch_scheme(
        "collectives", world=world_size, numel=numel, dtype=dtype, seed=seed, keep_history=keep_history
    )


# ------------------------------------------------------------------------------------------------ the scheme


def _check(opts: dict) -> None:
    if opts["world"] < 1:
        raise ValueError(f"world={opts['world']} must be >= 1")
    if opts["numel"] < opts["world"]:
        raise ValueError(f"numel={opts['numel']} must be >= world_size={opts['world']} (one chunk per rank)")


def _scheme_rank_fn(opts: dict) -> dict:
    return ring_rank_fn(opts["numel"], opts["dtype"], opts["seed"], opts.get("keep_history", False))


def _report(opts: dict, results: Results) -> dict:
    P, numel = opts["world"], opts["numel"]
    element_size = torch.empty(0, dtype=getattr(torch, opts["dtype"])).element_size()
    # The single-device reference: the plain sum of the ranks' inputs, computed here in one process.
    reference = torch.stack([r["input"] for r in results]).sum(dim=0)
    verdicts = [
        compare(f"ring all-reduce, rank {rank}", r["ring"], reference, show=False) for rank, r in enumerate(results)
    ]
    verdicts.append(compare("dist.all_reduce, rank 0", results[0]["all_reduce"], reference, show=False))
    comm_bytes = results.trace.bytes_per_rank()
    theory = ring_theory_bytes(numel, element_size, P)
    byte_checks = [
        check_equal(f"bytes sent by rank {rank}", sent, theory[rank], show=False)
        for rank, sent in enumerate(comm_bytes.get("send", [0] * P))
    ]
    worst = max(verdicts, key=lambda v: v.max_abs_err)
    return {
        "scheme": "collectives",
        "world_size": P,
        "passed": all(v.passed for v in verdicts + byte_checks),
        "max_abs_err": worst.max_abs_err,
        "tol": worst.tol,
        "comm": {**comm_bytes, "theory_bytes_per_rank": theory},
        "numel": numel,
        "tensor_bytes": numel * element_size,
        "verdicts": [v.line for v in verdicts + byte_checks],
    }


def _add_arguments(parser) -> None:
    parser.add_argument("--numel", type=int, default=1024, help="elements in the tensor each rank contributes")


SCHEMES = [
    Scheme(
        name="collectives",
        help="ring all-reduce written with send/recv, checked against dist.all_reduce",
        rank_fn=_scheme_rank_fn,
        report=_report,
        add_arguments=_add_arguments,
        check=_check,
        defaults={"numel": 1024},
    )
]


# ------------------------------------------------------------------------------------------------- pictures
# (plotly is imported inside these functions: rank code imports this module and must stay light)


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


def ring_demo_rank_fn() -> list:
    """Rank code for the picture: rank r contributes 2^r in every chunk, so a sum's bits name its contributors."""
    P, r = dist.get_world_size(), dist.get_rank()
    history: list = []
    ring_all_reduce(torch.full((P,), 2.0**r, dtype=torch.float64), history)
    return [torch.cat(snapshot) for snapshot in history]  # 2(P-1) + 1 snapshots, each [P] (one value a chunk)


def ring_step_sends(world_size: int, step: int) -> list[tuple[int, int, int]]:
    """The chunks in flight during `step` (1-based; 0 is the start): (from_rank, chunk, to_rank)."""
    P = world_size
    if step == 0:
        return []
    s = step - 1
    if s < P - 1:
        return [(r, (r - s) % P, (r + 1) % P) for r in range(P)]
    s -= P - 1
    return [(r, (r + 1 - s) % P, (r + 1) % P) for r in range(P)]


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
