# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The library's code
# called: the shuffle is parlab.schemes.expert_parallel's AllToAll and the counts its exchange_counts; the order of
# the rows is the student's own. Every number is right; the checks see the calls (and the all-to-alls) in every
# part that shuffles.
# EXPECT FAIL: dispatch, combine, capacity

# ANSWER: dispatch
from parlab.schemes.expert_parallel import AllToAll, exchange_counts


def swap_counts(counts, group=None):
    return exchange_counts(counts.reshape(-1).contiguous(), group).view(counts.shape)


class Shuffle:
    @staticmethod
    def apply(rows, out_splits, in_splits, group=None):
        return AllToAll.apply(rows, out_splits, in_splits, group, "rows")


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
