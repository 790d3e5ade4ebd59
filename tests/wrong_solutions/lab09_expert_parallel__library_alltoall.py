# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The library's code
# called: the shuffle is parlab.schemes.expert_parallel's AllToAll and the counts its exchange_counts; the order of
# the rows and the schedule are the student's own. Every number is right; the checks see the calls (and the
# all-to-alls) in every part that shuffles.
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


from parlab.schemes.expert_parallel import AllToAll, exchange_counts


def swap_counts(counts, group=None):
    P = counts.shape[0]
    got = exchange_counts(counts.reshape(-1).contiguous(), group).view(counts.shape)
    totals = counts.sum(dim=1)
    every = exchange_counts(totals.repeat(P).contiguous(), group).view(P, P)  # row s: rank s's totals
    return got, every


class Shuffle:
    @staticmethod
    def apply(rows, out_splits, in_splits, sends, group=None):
        return AllToAll.apply(rows, out_splits, in_splits, group, "rows")


def dispatch(x, expert, experts, group=None):
    P = comm.group_size(group)
    per = experts // P
    dest = expert % P
    slot = dest * per + expert // P
    order = torch.argsort(slot, stable=True)
    mine = torch.bincount(slot, minlength=experts).view(P, per)
    recv_counts, sends = swap_counts(mine, group)
    received = Shuffle.apply(x[order], recv_counts.sum(dim=1).tolist(), mine.sum(dim=1).tolist(), sends, group)
    return received, recv_counts, order
