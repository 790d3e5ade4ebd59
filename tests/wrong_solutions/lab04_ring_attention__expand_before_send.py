# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the ring step expands the K/V heads to the query heads
# first and passes the expanded block on. Every number is right (each rank expands correctly, and after the first
# step it simply receives blocks that are expanded already), but the ring carries nq/nkv = 3 times the bytes: the
# saving grouped-query attention exists for is lost on the wire.
# EXPECT FAIL: ring

# ANSWER: ring_step
def ring_step(q, k, v, out, lse):
    rank, P = dist.get_rank(), dist.get_world_size()
    group = q.shape[1] // k.shape[1]  # 3 at the first step; 1 once the blocks arrive expanded
    kv = torch.stack([k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)])  # [2, B, nq, T/P, hd]
    incoming = torch.empty_like(kv)
    works = [comm.irecv(incoming, (rank - 1) % P), comm.isend(kv, (rank + 1) % P)]
    o, block_lse = attend(q, kv[0], kv[1])
    out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
    comm.wait_all(works)
    return out, lse, incoming[0], incoming[1]
