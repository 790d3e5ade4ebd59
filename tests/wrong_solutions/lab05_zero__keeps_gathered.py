# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the product's forward
# saves the gathered W for backward instead of gathering it again (FSDP's reshard_after_forward=False: ZeRO-2's
# memory, not ZeRO-3's). The numbers are right and there is one all-gather less per product, but every matrix stays
# alive from its forward to its backward: the check sees the missing all-gathers, the gathered buffers alive after
# forward and the W kept for backward.
# EXPECT FAIL: zero3

# ANSWER: zero3
class Prefetcher:
    """What the uses share. shards: {name: this rank's [S] shard}; shapes: {name: (out, in)}; order: the matrix of
    each use, in the order forward makes them (uses_of(): use 0 the lookup, the last use the tied LM head)."""

    def __init__(self, shards: dict, shapes: dict, order: list[str]):
        self.shards, self.shapes, self.order = shards, shapes, order
        self.in_flight = {}  # use -> (the buffer [N*S] its all-gather fills, the all-gather's handle)

    def start(self, use: int) -> None:
        """Issue the all-gather of `use`'s matrix and return at once: the buffer fills while the caller computes."""
        shard = self.shards[self.order[use]].detach()  # [S]
        full = torch.empty(comm.group_size() * len(shard), dtype=shard.dtype, device=shard.device)  # [N*S]
        self.in_flight[use] = (full, comm.all_gather_into_tensor(full, shard, async_op=True))

    def take(self, use: int) -> torch.Tensor:
        """`use`'s matrix W [out, in], gathered: the all-gather issued earlier waited for (or issued now)."""
        if use not in self.in_flight:
            self.start(use)
        full, work = self.in_flight.pop(use)  # the prefetcher lets go: W lives as long as the caller holds it
        work.wait()
        out_features, in_features = self.shapes[self.order[use]]
        return full[: out_features * in_features].view(out_features, in_features)


class Zero3Linear(torch.autograd.Function):
    """y = x W^T where this rank holds only w_shard: its shard of W ([out, in] flattened, zero-padded to N*S)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_shard: torch.Tensor, pre: Prefetcher, use: int) -> torch.Tensor:
        """x: [..., in] this rank's activations; w_shard: [S]; pre: the Prefetcher; use: this use's index -> y:
        [..., out]."""
        w = pre.take(use)  # [out, in]: gathered while the use before this one computed
        if use + 1 < len(pre.order):
            pre.start(use + 1)  # the next use's all-gather, in flight while this product computes
        ctx.save_for_backward(x, w, w_shard)  # W kept for backward: no gather there
        ctx.pre, ctx.use = pre, use
        return x @ w.T  # [..., out]; w goes out of scope here: freed

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        """grad_y: [..., out], the gradient of this rank's own loss L_r -> (dL_r/dx: [..., in], w_shard's gradient:
        [S], this rank's shard of the global dL/dW, None, None)."""
        x, w, w_shard = ctx.saved_tensors
        grad_x = grad_y @ w  # [..., in]
        out_features, in_features = w.shape
        del w  # W is not needed any more: free it before the reduce-scatter
        N, S = comm.group_size(), len(w_shard)
        grad_w = torch.zeros(N * S, dtype=grad_y.dtype, device=grad_y.device)  # this rank's dL_r/dW, flat, padded
        rows_y, rows_x = grad_y.reshape(-1, out_features), x.reshape(-1, in_features)  # [b*T, out], [b*T, in]
        grad_w[: out_features * in_features] = (rows_y.T @ rows_x).reshape(-1)  # [out, in] from my rows only
        grad_shard = torch.empty(S, dtype=grad_y.dtype, device=grad_y.device)
        comm.reduce_scatter_tensor(grad_shard, grad_w)  # [S] the sum over ranks of my slice
        return grad_x, grad_shard / N, None, None


class Zero3Embedding(torch.autograd.Function):
    """E[idx] where this rank holds only w_shard: its shard of E ([V, H] flattened, zero-padded to N*S)."""

    @staticmethod
    def forward(ctx, idx: torch.Tensor, w_shard: torch.Tensor, pre: Prefetcher, use: int) -> torch.Tensor:
        """idx: [b, T] token ids; w_shard: [S]; pre: the Prefetcher; use: this use's index -> the rows of E:
        [b, T, H]."""
        w = pre.take(use)  # [V, H]
        pre.start(use + 1)  # the next use's all-gather, in flight while the rows are read
        ctx.save_for_backward(idx)
        ctx.shape, ctx.S = tuple(w.shape), len(w_shard)
        return w[idx]  # indexing copies the rows: the gathered E is freed

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        """grad_y: [b, T, H] -> (None for idx, w_shard's gradient: [S], None, None)."""
        (idx,) = ctx.saved_tensors
        (V, H), N, S = ctx.shape, comm.group_size(), ctx.S
        grad_w = torch.zeros(N * S, dtype=grad_y.dtype, device=grad_y.device)  # this rank's dL_r/dE, flat, padded
        grad_w[: V * H].view(V, H).index_add_(0, idx.reshape(-1), grad_y.reshape(-1, H))  # each row read gets its grad
        grad_shard = torch.empty(S, dtype=grad_y.dtype, device=grad_y.device)
        comm.reduce_scatter_tensor(grad_shard, grad_w)
        return None, grad_shard / N, None, None
