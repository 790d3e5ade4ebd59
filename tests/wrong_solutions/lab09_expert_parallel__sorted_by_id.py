# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb. The bug: the rows are sorted by expert id, as in lesson 09's
# layer, where the experts sit in contiguous blocks. The counts and the split sizes are right (so every buffer has
# the right size and nothing crashes), but under round-robin consecutive ids live on different ranks: the first
# rows rank 0 hands over are for experts 0 and 1, and rank 0 gets rows meant for rank 1. (Part 2's layer builds
# rows of its own and uses only the shuffle, so only the dispatch fails.)
# EXPECT FAIL: dispatch

# ANSWER: dispatch
class Shuffle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group=None):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), rows.shape[1])
        comm.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), grad.shape[1])
        comm.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def dispatch(x, expert, experts, group=None):
    P = comm.group_size(group)
    per = experts // P
    order = torch.argsort(expert, stable=True)  # by expert id: right only for contiguous blocks
    send_counts = torch.bincount((expert % P) * per + expert // P, minlength=experts)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all_single(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.view(P, per)
    send_splits = torch.bincount(expert % P, minlength=P).tolist()
    received = Shuffle.apply(x[order], recv_counts.sum(dim=1).tolist(), send_splits, group)
    return received, recv_counts, order
