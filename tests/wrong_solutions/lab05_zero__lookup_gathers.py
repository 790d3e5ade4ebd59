# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the lookup's backward
# gathers the embedding again, as the product's does, though the gradient of a lookup needs only which rows were
# read. Every number is right and nothing is kept; the backward makes one all-gather of the largest matrix too many,
# and the check says which.
# EXPECT FAIL: zero3

# ANSWER: zero3
class Zero3Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_shard, shape):
        N = comm.group_size()
        full = torch.empty(N * len(w_shard), dtype=w_shard.dtype)
        comm.all_gather_into_tensor(full, w_shard)
        ctx.save_for_backward(x, w_shard)
        ctx.shape = shape
        return x @ full[: shape[0] * shape[1]].view(shape).T

    @staticmethod
    def backward(ctx, grad_y):
        x, w_shard = ctx.saved_tensors
        (out_f, in_f), N, S = ctx.shape, comm.group_size(), len(w_shard)
        full = torch.empty(N * S, dtype=w_shard.dtype)
        comm.all_gather_into_tensor(full, w_shard)
        grad_x = grad_y @ full[: out_f * in_f].view(ctx.shape)
        del full
        grad_w = torch.zeros(N * S, dtype=grad_y.dtype)
        grad_w[: out_f * in_f] = (grad_y.reshape(-1, out_f).T @ x.reshape(-1, in_f)).reshape(-1)
        grad_shard = torch.empty(S, dtype=grad_y.dtype)
        comm.reduce_scatter_tensor(grad_shard, grad_w)
        return grad_x, grad_shard / N, None


class Zero3Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, w_shard, shape):
        N = comm.group_size()
        full = torch.empty(N * len(w_shard), dtype=w_shard.dtype)
        comm.all_gather_into_tensor(full, w_shard)
        ctx.save_for_backward(idx, w_shard)
        ctx.shape = shape
        return full[: shape[0] * shape[1]].view(shape)[idx]

    @staticmethod
    def backward(ctx, grad_y):
        idx, w_shard = ctx.saved_tensors
        (V, H), N, S = ctx.shape, comm.group_size(), len(w_shard)
        full = torch.empty(N * S, dtype=w_shard.dtype)
        comm.all_gather_into_tensor(full, w_shard)  # as in the product's backward: not needed here
        del full
        grad_w = torch.zeros(N * S, dtype=grad_y.dtype)
        grad_w[: V * H].view(V, H).index_add_(0, idx.reshape(-1), grad_y.reshape(-1, H))
        grad_shard = torch.empty(S, dtype=grad_y.dtype)
        comm.reduce_scatter_tensor(grad_shard, grad_w)
        return None, grad_shard / N, None
