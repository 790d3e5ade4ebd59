# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the ring step posts its transfers with isend/irecv but
# waits for them at once, before computing the tile. The numbers are right and nothing deadlocks, but the transfer
# is never in flight while the tile computes: the communication is serial, the ring's point is lost.
# EXPECT FAIL: ring

# ANSWER: ring_step
def ring_step(q, k, v, out, lse):
    rank, P = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    incoming = torch.empty_like(kv)
    comm.wait_all([comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)])
    group = q.shape[1] // k.shape[1]
    o, block_lse = attend(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
    return out, lse, incoming[0], incoming[1]
