"""Collectives, seen from the ranks: who holds which chunk before and after, and a ring all-reduce by hand.

Lesson 00 shows each of broadcast, all-reduce, reduce-scatter, all-gather, all-to-all and send/recv chunk by chunk
(parlab/lessons/collectives.py), and then `ring_all_reduce`: an all-reduce written with nothing but send and recv.

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

from parlab.core import comm

# ----------------------------------------------------------------------------------------- the ring all-reduce


def ring_all_reduce(tensor: torch.Tensor, history: list | None = None, group=None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` (default: all) with send/recv only; returns the sum (every rank gets
    all of it).

    tensor: any shape, the same on every rank. history: if a list, it receives a snapshot of this rank's chunks
    (a list of P tensors) before the first step and after each of the 2(P-1) steps, for drawing.
    """
    P, r = comm.group_size(group), comm.group_rank(group)
    # The neighbours on the ring are ranks of the group; send/recv address processes by their global rank.
    right, left = comm.global_rank(group, (r + 1) % P), comm.global_rank(group, (r - 1) % P)
    # P chunks along the flattened tensor; tensor_split also handles N not divisible by P (chunks differ by 1).
    chunks = [c.clone() for c in tensor.flatten().tensor_split(P)]
    if history is not None:
        history.append([c.clone() for c in chunks])

    def exchange(send_index: int, recv_index: int, step: str) -> torch.Tensor:
        incoming = torch.empty_like(chunks[recv_index])
        # Post both at once: if every rank first did a blocking send, no rank would be receiving.
        works = [
            comm.isend(chunks[send_index], right, group=group, label=step),
            comm.irecv(incoming, left, group=group, label=step),
        ]
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


def ring_step_sends(world_size: int, step: int) -> list[tuple[int, int, int]]:
    """The chunks in flight during `step` of `ring_all_reduce` (1-based; 0 is the start): (from_rank, chunk,
    to_rank), by the same rule as the loops above."""
    P = world_size
    if step == 0:
        return []
    s = step - 1
    if s < P - 1:
        return [(r, (r - s) % P, (r + 1) % P) for r in range(P)]
    s -= P - 1
    return [(r, (r + 1 - s) % P, (r + 1) % P) for r in range(P)]


# ------------------------------------------------------------------------------------------------- the theory


def ring_theory_bytes(numel: int, element_size: int, world_size: int) -> list[int]:
    """Bytes each rank sends in a ring all-reduce, in rank order: 2(P-1) chunks, i.e. 2(P-1)/P x N bytes
    when P divides N (otherwise chunks differ by one element and so do the ranks' totals)."""
    P = world_size
    chunk_sizes = [len(c) for c in torch.arange(numel).tensor_split(P)]  # host: only the sizes are used
    # Over the 2(P-1) steps rank r sends chunks (r - s) for s < P-1, then (r + 1 - s): each chunk but one, twice.
    per_rank = [
        sum(chunk_sizes[(r - s) % P] for s in range(P - 1)) + sum(chunk_sizes[(r + 1 - s) % P] for s in range(P - 1))
        for r in range(P)
    ]
    return [n * element_size for n in per_rank]
