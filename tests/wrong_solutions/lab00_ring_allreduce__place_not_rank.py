# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: owner[k] read as a place on the ring, not a rank: piece k is finished on ring[owner[k]]. On a
# ring in rank order that is the same thing; on [0, 2, 3, 1] the pieces owned by rank 1 end on rank 2. Every message is
# a partial sum over a run of ranks, but the runs start after the wrong rank: the FAIL line says whose sum it holds.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(pieces, owner, ring, touched):
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]
    owned = {ring[q]: [k for k, o in enumerate(owner) if o == q] for q in range(P)}
    for s in range(P - 1):
        out, into = owned[ring[(m - 1 - s) % P]], owned[ring[(m - 2 - s) % P]]
        out = [k for k in out if any(touched[q][k] for q in range(P))]  # pieces somebody touched
        into = [k for k in into if any(touched[q][k] for q in range(P))]
        sizes = [pieces[k].numel() for k in into]
        works = []
        if out:
            works.append(comm.isend(torch.cat([pieces[k] for k in out]), right))
        if into:
            incoming = pieces[into[0]].new_empty(sum(sizes))
            works.append(comm.irecv(incoming, left))
        comm.wait_all(works)
        for k, part in zip(into, incoming.split(sizes) if into else [], strict=True):
            pieces[k] += part
