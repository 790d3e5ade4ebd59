# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: the rows go in
# the shifted rounds (round k: rank r sends to r + k and receives from r - k), the lesson's ring with a shift of k,
# skipping the shifts in which no rank has a message. Every number is right and each round is a real round, but on
# the check's routing the shifts chain into 3 rounds where 2 suffice (no rank sends to or receives from more than
# two others), and the kernel's patterns find more. Parts 2 and 4 do not count rounds.
# EXPECT FAIL: dispatch

# ANSWER: dispatch
def schedule(pattern):
    P = len(pattern)
    rounds = []
    for k in range(1, P):  # round k: every rank sends to r + k, receives from r - k
        pairs = [(s, (s + k) % P) for s in range(P) if pattern[s][(s + k) % P]]
        if pairs:  # a shift in which no rank has a message is skipped
            rounds.append(pairs)
    return rounds


def exchange(outgoing: list, incoming: list, rounds: list, group=None) -> None:
    """Rank code: one exchange in `rounds` (schedule's result, the same on every rank). outgoing[d]: the tensor for
    rank d; incoming[s]: the buffer rank s's message fills. In each round this rank sends at most one message and
    receives at most one, both in flight at once, and nothing deadlocks where a send completes only once its receive
    is posted."""
    r = comm.group_rank(group)
    for pairs in rounds:
        works = []
        for s, d in pairs:
            if s == r:
                works.append(comm.isend(outgoing[d].contiguous(), comm.global_rank(group, d), group=group))
            if d == r:
                works.append(comm.irecv(incoming[s], comm.global_rank(group, s), group=group))
        comm.wait_all(works)  # the round ends here: nothing of the next is in flight with it


def swap_counts(counts: torch.Tensor, group=None):
    """Rank code. counts [P, c] int64, row d for rank d -> (got [P, c]: row s from rank s, row r my own; rows [P, P]
    int64: rows[s, d] the number of rows rank s sends rank d, counts[d].sum() on rank s, known to every rank)."""
    P, r = comm.group_size(group), comm.group_rank(group)
    c = counts.shape[1]
    totals = counts.sum(dim=1)  # [P] my rows for each rank: every rank needs them to schedule the rows
    outgoing = [torch.cat([counts[d], totals]) for d in range(P)]  # c + P <= E numbers a message
    got = torch.empty(P, c + P, dtype=counts.dtype, device=counts.device)
    got[r] = outgoing[r]
    everyone = [[s != d for d in range(P)] for s in range(P)]  # a receiver cannot tell a zero from silence
    exchange(outgoing, list(got), schedule(everyone), group)
    return got[:, :c].contiguous(), got[:, c:].contiguous()


def shuffle_rows(rows: torch.Tensor, out_splits: list, in_splits: list, sends: torch.Tensor, group=None):
    """Rank code, no autograd. rows [sum(in_splits), H], in_splits[d] of them (consecutive) for rank d -> rows
    [sum(out_splits), H], out_splits[s] of them from rank s, stacked by source rank. sends [P, P]: sends[s, d] the
    rows rank s sends rank d in this exchange (the same on every rank)."""
    r = comm.group_rank(group)
    out = rows.new_empty(sum(out_splits), rows.shape[1])
    sending = list(rows.contiguous().split(in_splits))  # chunk d: my rows for rank d
    arriving = list(out.split(out_splits))  # chunk s: views into out, stacked by source whatever the round
    arriving[r].copy_(sending[r])  # my rows for my own experts never travel
    exchange(sending, arriving, schedule((sends > 0).tolist()), group)
    return out


class Shuffle(torch.autograd.Function):
    """shuffle_rows, differentiable: its backward sends each row's gradient back where the row came from."""

    @staticmethod
    def forward(ctx, rows, out_splits: list, in_splits: list, sends: torch.Tensor, group=None):
        ctx.splits, ctx.sends, ctx.group = (out_splits, in_splits), sends, group
        return shuffle_rows(rows, out_splits, in_splits, sends, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return shuffle_rows(grad, in_splits, out_splits, ctx.sends.T, ctx.group), None, None, None, None


def dispatch(x: torch.Tensor, expert: torch.Tensor, experts: int, group=None):
    """Rank code. x: [n, H] this rank's rows; expert: [n] int64, the expert of each row (E = experts).
    Returns (received [R, H], recv_counts [P, E/P] int64, order [n]: x[order] is what this rank sent, in order)."""
    P = comm.group_size(group)
    per = experts // P
    dest = expert % P  # [n] the rank that holds each row's expert
    slot = dest * per + expert // P  # [n] position of the expert in the travel order: by rank, then local index
    order = torch.argsort(slot, stable=True)  # rows for rank 0's experts first, each expert's rows in their order
    mine = torch.bincount(slot, minlength=experts).view(P, per)  # [P, E/P] row d: my rows for rank d's experts
    recv_counts, sends = swap_counts(mine, group)  # [P, E/P] row s: rank s's rows for my experts; [P, P]
    received = Shuffle.apply(x[order], recv_counts.sum(dim=1).tolist(), mine.sum(dim=1).tolist(), sends, group)
    return received, recv_counts, order
