# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The library's code
# pasted: the shuffle is parlab.schemes.expert_parallel's AllToAll copied into the cell (all_to_all_single with
# split sizes) and the counts its exchange_counts (an all-to-all too); no call into the library, every number right.
# But this lab has no all-to-all: every part that shuffles sees the collectives and fails, naming them.
# EXPECT FAIL: dispatch, combine, capacity

# ANSWER: dispatch
def swap_counts(counts, group=None):
    got = torch.empty_like(counts.reshape(-1))
    comm.all_to_all_single(got, counts.reshape(-1).contiguous(), group=group)  # chunk r of the counts goes to rank r
    return got.view(counts.shape)


class Shuffle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group=None):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), x.shape[1])
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), grad.shape[1])
        comm.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def dispatch(x, expert, experts, group=None):
    P = comm.group_size(group)
    per = experts // P
    dest = expert % P
    slot = dest * per + expert // P
    order = torch.argsort(slot, stable=True)
    mine = torch.bincount(slot, minlength=experts).view(P, per)
    recv_counts = swap_counts(mine, group)
    received = Shuffle.apply(x[order], recv_counts.sum(dim=1).tolist(), mine.sum(dim=1).tolist(), group)
    return received, recv_counts, order
