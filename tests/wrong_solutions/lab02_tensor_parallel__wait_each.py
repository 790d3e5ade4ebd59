# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the ring is
# right (the x blocks and the partial sums go round, each rank its own units, a few blocks held at a time), but every
# receive is waited for before the GEMM it could have hidden behind: each transfer's time adds to the compute's
# instead of overlapping it.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, layout) -> torch.Tensor:
    """x: [B, n_r, H], this rank's tokens (layout[s] lists rank s's); gate, up: [F, H], down: [H, F], whole on every
    rank -> y: [B, n_r, H], this rank's tokens of the MLP's output. Forward only."""
    r, ranks = dist.get_rank(), dist.get_world_size()
    F_ = gate.shape[0]
    mine = slice(r * F_ // ranks, (r + 1) * F_ // ranks)  # this rank's hidden units: silu acts unit by unit
    w_gate, w_up, w_down = gate[mine], up[mine], down[:, mine]  # [F/P, H], [F/P, H], [H, F/P] (views)
    nxt, prv = (r + 1) % ranks, (r - 1) % ranks
    B, _, H = x.shape

    def share(block: torch.Tensor) -> torch.Tensor:  # [B, n, H] -> this rank's units' share of their output
        return (F.silu(block @ w_gate.T) * (block @ w_up.T)) @ w_down.T

    def empty(j: int) -> torch.Tensor:  # a buffer for rank j's tokens, [B, n_j, H]
        return x.new_empty(B, len(layout[j]), H)

    # Every message goes to rank r - 1 and comes from rank r + 1. Step k computes block j = r + k: the x blocks arrive
    # in that order (each rank passes on the block it computes), and block j's partial sum starts on rank j - 1
    # (step 1) and gathers a share on every rank down to j + 1 (step P - 1), which hands the sum to its owner j. Rank
    # r's own block is computed at step 0 and its share kept until its sum comes back. Messages from one neighbour are
    # matched in the order they were posted: each step posts the partial's receive first, as the neighbour sent it a
    # step earlier. Whatever has left is let go at once: a rank holds a few blocks, whatever P.
    block, y, leaving = x, None, []
    for k in range(ranks):
        j = (r + k) % ranks
        if k >= 2:  # block j's sum so far, from rank r + 1 (its step k - 1)
            incoming = empty(j)
            partial_recv = comm.irecv(incoming, nxt)
        if k == ranks - 1:  # my own block's sum of every other rank's share, from rank r + 1's last step
            total = empty(r)
            total_recv = comm.irecv(total, nxt)
        if k < ranks - 1:  # the next block comes in while this one computes; this one goes on
            ahead = empty((j + 1) % ranks)
            ahead_recv = comm.irecv(ahead, nxt)
            block_send = comm.isend(block, prv)
        if k >= 2:
            partial_recv.wait()  # the bug: each receive waited for before the GEMM it could hide behind
        if k < ranks - 1:
            ahead_recv.wait()
        out = share(block)  # [B, n_j, H]
        comm.wait_all(leaving)  # the partial sum sent at the last step has left: its buffer is let go
        leaving = []
        if k == 0:
            y = out  # my own tokens' share: the sum comes back at the end
        else:
            if k >= 2:
                out += incoming  # (already waited for)
            leaving.append(comm.isend(out, prv))  # on to rank r - 1 (at the last step: its owner)
        if k < ranks - 1:
            block_send.wait()  # the block this step computed has left: only the next one is held
            block = ahead
    total_recv.wait()
    comm.wait_all(leaving)
    return y + total
