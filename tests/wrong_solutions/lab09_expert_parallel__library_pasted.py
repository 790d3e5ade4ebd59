# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (the other answers are the solution's). The library's code
# pasted: the shuffle is parlab.schemes.expert_parallel's AllToAll copied into the cell (all_to_all_single with
# split sizes) and the counts its exchange_counts (an all-to-all too); no call into the library, every number right.
# But this lab has no all-to-all: every part that shuffles sees the collectives and fails, naming them.
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


def swap_counts(counts, group=None):
    P = counts.shape[0]
    got = torch.empty_like(counts.reshape(-1))
    comm.all_to_all_single(got, counts.reshape(-1).contiguous(), group=group)  # chunk r of the counts goes to rank r
    every = torch.empty(P * P, dtype=counts.dtype, device=counts.device)
    comm.all_to_all_single(every, counts.sum(dim=1).repeat(P).contiguous(), group=group)
    return got.view(counts.shape), every.view(P, P)


class Shuffle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, sends, group=None):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), x.shape[1])
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), grad.shape[1])
        comm.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None, None


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
