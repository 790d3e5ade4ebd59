# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the receive buffer is sized like the bucket this rank sends, not like the one that arrives.
# Where every owner's pieces add up to the same size nothing would show; with owner maps of uneven buckets a rank
# receives a bucket of one size into a buffer of another and the check's run fails on its ranks.
# EXPECT FAIL: reduce_scatter

# ANSWER: reduce_scatter
def reduce_scatter_phase(pieces, owner, ring, touched):
    P, r = dist.get_world_size(), dist.get_rank()
    m = ring.index(r)
    right, left = ring[(m + 1) % P], ring[(m - 1) % P]

    def carried(k, place):  # piece k no longer all zero when the rank at `place` passes it on
        o = ring.index(owner[k])
        return any(touched[ring[(o + j) % P]][k] for j in range(1, (place - o) % P + 1))

    owned = {q: [k for k, o in enumerate(owner) if o == q] for q in ring}
    for s in range(P - 1):
        out, into = owned[ring[(m - 1 - s) % P]], owned[ring[(m - 2 - s) % P]]
        out, into = [k for k in out if carried(k, m)], [k for k in into if carried(k, (m - 1) % P)]
        message = torch.cat([pieces[k] for k in out]) if out else pieces[0].new_empty(0)
        incoming = torch.empty_like(message)
        comm.wait_all([comm.isend(message, right), comm.irecv(incoming, left)])
        for k, part in zip(into, incoming.split([pieces[k].numel() for k in into]), strict=False):
            pieces[k] += part
