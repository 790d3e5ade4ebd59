# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the ring of
# part 1 with every block padded to the largest rank's count, so that one buffer size serves every step (as the
# library's collectives pad). Values and gradients are right, the messages go between neighbours only, but a rank
# with fewer tokens than the largest receives (gather) or sends (reduce-scatter) padding.
# EXPECT FAIL: conjugates

# ANSWER: conjugates
def gather_tokens(x: torch.Tensor, layout: list[list[int]]) -> torch.Tensor:
    """x: [B, n_r, H], this rank's tokens (x[:, i] is token layout[r][i]) -> [B, T, H], the whole sequence in
    order, on every rank. Backward: this rank's tokens of the gradients summed over the ranks."""
    return GatherTokens.apply(x, layout)


def scatter_tokens(partial: torch.Tensor, layout: list[list[int]]) -> torch.Tensor:
    """partial: [B, T, H], this rank's partial sum -> [B, n_r, H], this rank's tokens of the ranks' sum.
    Backward: the gradient of every token, on every rank."""
    return ScatterTokens.apply(partial, layout)


def ring_gather(x: torch.Tensor, layout: list[list[int]]) -> torch.Tensor:
    """[B, n_r, H] this rank's tokens -> [B, T, H] the whole sequence in order, on every rank.

    A ring of blocks of their own sizes: at step k each rank passes on to rank r + 1 the block it received at step
    k - 1 (rank r - k + 1's) and receives rank r - k's from rank r - 1. Each block crosses P - 1 links; each rank
    receives every other rank's tokens once, unpadded (the layout tells both ends every block's size)."""
    r, ranks = dist.get_rank(), len(layout)
    nxt, prv = (r + 1) % ranks, (r - 1) % ranks
    B, _, H = x.shape
    whole = x.new_empty(B, sum(map(len, layout)), H)  # [B, T, H]
    whole[:, layout[r]] = x
    most = max(map(len, layout))  # every block padded to the largest: one buffer size for every step
    block = x.new_zeros(B, most, H)
    block[:, : len(layout[r])] = x
    for k in range(1, ranks):
        src = (r - k) % ranks  # whose block arrives at this step
        incoming = x.new_empty(B, most, H)  # [B, max n, H]
        recv, send = comm.irecv(incoming, prv), comm.isend(block, nxt)
        recv.wait()
        send.wait()
        whole[:, layout[src]] = incoming[:, : len(layout[src])]  # rank order -> sequence order
        block = incoming  # passed on at the next step
    return whole


def ring_reduce_scatter(z: torch.Tensor, layout: list[list[int]]) -> torch.Tensor:
    """[B, T, H] this rank's partial sums -> [B, n_r, H] this rank's tokens of the ranks' sum.

    Block j's sum starts on rank j + 1 and goes round to j, each rank adding its share on the way: at step k rank r
    sends its running sum of block r - k and receives rank r - 1's of block r - k - 1; at the last step that is its
    own block. Each rank sends its partial of every token but its own, once."""
    r, ranks = dist.get_rank(), len(layout)
    nxt, prv = (r + 1) % ranks, (r - 1) % ranks
    B, _, H = z.shape
    most = max(map(len, layout))  # every block padded to the largest
    running = z.new_zeros(B, most, H)
    running[:, : len(layout[prv])] = z[:, layout[prv]]  # block r - 1: this rank's share starts its sum
    for k in range(1, ranks):
        j = (r - k - 1) % ranks  # the block whose running sum arrives at this step
        incoming = z.new_empty(B, most, H)  # [B, max n, H]
        recv, send = comm.irecv(incoming, prv), comm.isend(running, nxt)
        recv.wait()
        send.wait()
        running = incoming.clone()
        running[:, : len(layout[j])] += z[:, layout[j]]  # this rank's share added
    return running[:, : len(layout[r])]


class GatherTokens(torch.autograd.Function):
    """The whole sequence gathered forward, reduce-scattered backward (Megatron-SP's g, for any layout, unpadded)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: list[list[int]]) -> torch.Tensor:
        ctx.layout = layout
        return ring_gather(x, layout)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ring_reduce_scatter(grad, ctx.layout), None  # every rank's partial dL/dx, my tokens of the sum


class ScatterTokens(torch.autograd.Function):
    """Reduce-scattered forward, the whole sequence gathered backward (Megatron-SP's g-bar, for any layout)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, layout: list[list[int]]) -> torch.Tensor:
        ctx.layout = layout
        return ring_reduce_scatter(partial, layout)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ring_gather(grad.contiguous(), ctx.layout), None  # every partial sum fed every token: dL/dy of all
