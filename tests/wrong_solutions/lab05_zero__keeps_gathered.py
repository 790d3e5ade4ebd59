# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the product's forward
# saves the gathered W for backward instead of gathering it again (FSDP's reshard_after_forward=False: ZeRO-2's
# memory, not ZeRO-3's). The numbers are right and there is one all-gather less per product, but every matrix stays
# alive from its forward to its backward: the check sees the missing all-gathers, the gathered buffers alive after
# forward, the peak of all of them at once and the W kept for backward.
# EXPECT FAIL: zero3

# ANSWER: zero3
class Zero3Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_shard, shape):
        N = comm.group_size()
        full = torch.empty(N * len(w_shard), dtype=w_shard.dtype)
        comm.all_gather_into_tensor(full, w_shard)
        w = full[: shape[0] * shape[1]].view(shape)
        ctx.save_for_backward(x, w, w_shard)
        return x @ w.T

    @staticmethod
    def backward(ctx, grad_y):
        x, w, w_shard = ctx.saved_tensors
        N, S = comm.group_size(), len(w_shard)
        grad_x = grad_y @ w
        grad_w = torch.zeros(N * S, dtype=grad_y.dtype)
        grad_w[: w.numel()] = (grad_y.reshape(-1, w.shape[0]).T @ x.reshape(-1, w.shape[1])).reshape(-1)
        grad_shard = torch.empty(S, dtype=grad_y.dtype)
        comm.reduce_scatter_tensor(grad_shard, grad_w)
        return grad_x, grad_shard / N, None


class Zero3Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, w_shard, shape):
        N = comm.group_size()
        full = torch.empty(N * len(w_shard), dtype=w_shard.dtype)
        comm.all_gather_into_tensor(full, w_shard)
        ctx.save_for_backward(idx)
        ctx.shape, ctx.S = shape, len(w_shard)
        return full[: shape[0] * shape[1]].view(shape)[idx]

    @staticmethod
    def backward(ctx, grad_y):
        (idx,) = ctx.saved_tensors
        (V, H), N, S = ctx.shape, comm.group_size(), ctx.S
        grad_w = torch.zeros(N * S, dtype=grad_y.dtype)
        grad_w[: V * H].view(V, H).index_add_(0, idx.reshape(-1), grad_y.reshape(-1, H))
        grad_shard = torch.empty(S, dtype=grad_y.dtype)
        comm.reduce_scatter_tensor(grad_shard, grad_w)
        return None, grad_shard / N, None
