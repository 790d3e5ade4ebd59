# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: two phases.
# Phase A passes the x blocks round the ring, each receive hidden behind the GEMMs of the block in hand, and keeps
# this rank's share of every block's output; phase B, once the last GEMM is done, sums the shares with a plain
# blocking ring reduce, the same way round. y is exact, the units and the work are right, every message goes to the
# same neighbour; but a rank holds every block's partial result at once (on 8 ranks, more than the bound), and
# phase B's receives have no GEMM left to hide behind.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
def swiglu(x, gate, up, down, layout):
    r, ranks = dist.get_rank(), dist.get_world_size()
    F_ = gate.shape[0]
    mine = slice(r * F_ // ranks, (r + 1) * F_ // ranks)
    w_gate, w_up, w_down = gate[mine], up[mine], down[:, mine]
    nxt, prv = (r + 1) % ranks, (r - 1) % ranks
    B, _, H = x.shape

    def share(block):
        return (F.silu(block @ w_gate.T) * (block @ w_up.T)) @ w_down.T

    # Phase A: block r + k in hand at step k, the next one on its way meanwhile.
    outs, block = {}, x
    for k in range(ranks):
        j = (r + k) % ranks
        if k < ranks - 1:
            ahead = x.new_empty(B, len(layout[(j + 1) % ranks]), H)
            got = comm.irecv(ahead, nxt)
            gone = comm.isend(block, prv)
        outs[j] = share(block)  # every block's share, kept
        if k < ranks - 1:
            got.wait()
            gone.wait()
            block = ahead
    # Phase B: block j's sum starts on rank j - 1 and goes down to j, one blocking step at a time.
    running = outs[nxt]
    for k in range(1, ranks):
        j = (r + k + 1) % ranks
        incoming = x.new_empty(B, len(layout[j]), H)
        if r % 2 == 0:
            comm.send(running, prv)
            comm.recv(incoming, nxt)
        else:
            comm.recv(incoming, nxt)
            comm.send(running, prv)
        running = outs[j] + incoming
    return running
