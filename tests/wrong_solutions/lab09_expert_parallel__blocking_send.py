# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The bug: each round
# makes a blocking send, then a blocking receive. A send completes only once its receive is posted (gloo's blocking
# send waits for its receiver), and in the first round of counts every rank sends first: none is receiving, and
# every rank deadlocks (parlab.launch names it). The parts that shuffle lose their points; the prediction keeps its
# own (the schedule alone is right).
# EXPECT FAIL: dispatch, combine, capacity

# ANSWER: dispatch
def schedule(pattern: list) -> list:
    """Pure, the same on every rank. pattern[s][d]: True if rank s sends rank d one message (never s to itself).
    Returns the rounds, each a list of (s, d) pairs in which every rank sends at most once and receives at most
    once; every message of the pattern in exactly one round; as few rounds as the pattern allows."""
    P = len(pattern)
    edges = [(s, d) for s in range(P) for d in range(P) if s != d and pattern[s][d]]
    out = [sum(1 for s, _ in edges if s == r) for r in range(P)]
    into = [sum(1 for _, d in edges if d == r) for r in range(P)]
    colours = max(out + into + [0])  # the busiest rank's messages: no schedule can take fewer rounds
    sending = [{} for _ in range(P)]  # sending[s][c] = d: in round c rank s sends to d
    receiving = [{} for _ in range(P)]  # receiving[d][c] = s
    for s, d in edges:  # senders and receivers are two sides of a bipartite graph: colour its edges (Koenig)
        a = next(c for c in range(colours) if c not in sending[s])  # a round in which s is free
        b = next(c for c in range(colours) if c not in receiving[d])  # a round in which d is free
        if a != b and a in receiving[d]:
            # d is busy in round a: swap rounds a and b along the path d -a- s1 -b- d2 -a- ...; it never reaches s
            # (it meets senders only through a-edges, and s has none), so afterwards round a is free at both ends
            path, node, side, c = [], d, "recv", a
            while True:
                table = receiving if side == "recv" else sending
                if c not in table[node]:
                    break
                other = table[node][c]
                edge = (other, node) if side == "recv" else (node, other)
                path.append((edge, c))
                node, side, c = other, ("send" if side == "recv" else "recv"), (b if c == a else a)
            for (u, v), c in path:
                del sending[u][c], receiving[v][c]
            for (u, v), c in path:
                flipped = b if c == a else a
                sending[u][flipped], receiving[v][flipped] = v, u
        sending[s][a], receiving[d][a] = d, s
    return [[(s, sending[s][c]) for s in range(P) if c in sending[s]] for c in range(colours)]


def exchange(outgoing, incoming, rounds, group=None):
    r = comm.group_rank(group)
    for pairs in rounds:
        for s, d in pairs:  # send first, then receive
            if s == r:
                comm.send(outgoing[d].contiguous(), comm.global_rank(group, d), group=group)
        for s, d in pairs:
            if d == r:
                comm.recv(incoming[s], comm.global_rank(group, s), group=group)


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
