# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The easy route: the dense ring over owners' buckets (each owner's pieces start one place after
# it and move one place a step), the touched map ignored. Every piece ends summed on its owner and every message is a
# partial sum over the ranks it passed through; but a rank that touched nothing of a piece still sends its zeros, and
# the FAIL line names the first message that carries a partial sum still all zero.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(pieces, owner, ring, touched):
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]
    owned = {q: [k for k, o in enumerate(owner) if o == q] for q in ring}
    for s in range(P - 1):
        out, into = owned[ring[(m - 1 - s) % P]], owned[ring[(m - 2 - s) % P]]
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
