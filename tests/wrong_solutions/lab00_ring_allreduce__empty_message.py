# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the sparse schedule is right (a piece travels only once a rank since its owner has
# touched it) but every step still posts a send and a receive, an empty one when nothing non-zero is due: the
# receiver is not trusted to know from the map that nothing comes. Every byte is right; each empty message still
# pays the link's latency, and the FAIL line names the first one.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(pieces, owner, ring, touched):
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]

    def carried(k, place):
        o = ring.index(owner[k])
        return any(touched[ring[(o + j) % P]][k] for j in range(1, (place - o) % P + 1))

    K = len(pieces)
    for s in range(P - 1):
        out = [k for k in range(K) if owner[k] == ring[(m - 1 - s) % P] and carried(k, m)]
        into = [k for k in range(K) if owner[k] == ring[(m - 2 - s) % P] and carried(k, (m - 1) % P)]
        sizes = [pieces[k].numel() for k in into]
        message = torch.cat([pieces[k] for k in out]) if out else pieces[0].new_empty(0)
        incoming = pieces[0].new_empty(sum(sizes))
        comm.wait_all([comm.isend(message, right), comm.irecv(incoming, left)])
        for k, part in zip(into, incoming.split(sizes), strict=True):
            pieces[k] += part
