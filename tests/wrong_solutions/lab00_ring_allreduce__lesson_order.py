# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the lesson's loop moved onto owners' buckets as it is: at step s the rank at place m sends the
# bucket of the owner at place m - s, so its first message is its own pieces, and every bucket finishes one place
# further on, on the rank after its owner. The FAIL line names the first message that carries a piece its sender owns.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(pieces, owner, ring, touched):
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]
    owned = {q: [k for k, o in enumerate(owner) if o == q] for q in ring}
    for s in range(P - 1):
        out, into = owned[ring[(m - s) % P]], owned[ring[(m - 1 - s) % P]]
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
