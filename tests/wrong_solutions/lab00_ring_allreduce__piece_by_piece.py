# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The easy route: the lesson's ring run once per piece (piece k set out on the rank after its owner,
# sent only once a rank since its owner has touched it), one message per piece per step. Every sum, every partial sum and every byte is right, but a rank that forwards
# several pieces sends more than the ring's P-1 messages: each one pays the link's latency.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(pieces, owner, ring, touched):
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]

    def carried(k, place):  # piece k no longer all zero when the rank at `place` passes it on
        o = ring.index(owner[k])
        return any(touched[ring[(o + j) % P]][k] for j in range(1, (place - o) % P + 1))

    for s in range(P - 1):
        works, arriving = [], []
        for k in range(len(pieces)):
            o = ring.index(owner[k])
            if (o + 1 + s) % P == m and carried(k, m):  # piece k is here at step s: pass it on
                works.append(comm.isend(pieces[k], right))
            if (o + 2 + s) % P == m and carried(k, (m - 1) % P):  # piece k arrives here at step s
                arriving.append((k, torch.empty_like(pieces[k])))
                works.append(comm.irecv(arriving[-1][1], left))
        comm.wait_all(works)
        for k, incoming in arriving:
            pieces[k] += incoming
