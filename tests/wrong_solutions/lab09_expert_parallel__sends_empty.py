# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: a pair
# without rows still exchanges a rows message, of 0 rows (the counts already told the receiver there is nothing):
# rank 1, which has no rows, sends three. Every number is right; the messages are not the least. Parts 2 and 4
# count rows, not empty messages.
# EXPECT FAIL: dispatch

# ANSWER: dispatch
def exchange(outgoing, incoming, group=None):
    P, r = comm.group_size(group), comm.group_rank(group)
    for s in range(1, P):
        to, came = (r + s) % P, (r - s) % P
        works = []
        if outgoing[to] is not None:
            works.append(comm.isend(outgoing[to].contiguous(), to, group=group))
        if incoming[came] is not None:
            works.append(comm.irecv(incoming[came], came, group=group))
        comm.wait_all(works)


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
    exchange(sending, arriving, group)  # every pair, empty or not
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
