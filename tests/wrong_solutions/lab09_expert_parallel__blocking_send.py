# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: each round
# makes a blocking send, then a blocking receive. A send completes only once its receive is posted (gloo's
# blocking send waits for its receiver), and in every round every rank sends first: none is receiving, and the
# first round of counts deadlocks on every rank (parlab.launch names it). The parts that shuffle lose their points;
# the prediction keeps its own (its measurement is shown, not scored).
# EXPECT FAIL: dispatch, combine, capacity

# ANSWER: dispatch
def exchange(outgoing, incoming, group=None):
    P, r = comm.group_size(group), comm.group_rank(group)
    for s in range(1, P):
        to, came = (r + s) % P, (r - s) % P
        if outgoing[to] is not None:
            comm.send(outgoing[to].contiguous(), to, group=group)  # waits for rank `to`, itself sending
        if incoming[came] is not None:
            comm.recv(incoming[came], came, group=group)


def swap_counts(counts, group=None):
    r = comm.group_rank(group)
    got = torch.empty_like(counts)
    got[r] = counts[r]
    exchange(list(counts), list(got), group)
    return got


def shuffle_rows(rows, out_splits, in_splits, group=None):
    r = comm.group_rank(group)
    out = rows.new_empty(sum(out_splits), rows.shape[1])
    sending = list(rows.contiguous().split(in_splits))
    arriving = list(out.split(out_splits))
    arriving[r].copy_(sending[r])
    exchange([t if len(t) else None for t in sending], [t if len(t) else None for t in arriving], group)
    return out


class Shuffle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group=None):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return shuffle_rows(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return shuffle_rows(grad, in_splits, out_splits, ctx.group), None, None, None


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
