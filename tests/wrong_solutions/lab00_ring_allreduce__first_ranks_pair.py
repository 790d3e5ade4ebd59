# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The design: the textbook 2D all-reduce mended for nodes of different sizes by letting only the first
# M = min(L) local ranks of each node talk across nodes: x cut into M segments, each reduced inside the node onto local
# rank l < M (a ring reduce-scatter to owners, the other ranks owning nothing), all-reduced round a ring of local rank
# l of every node, then passed round the node to every rank. On two nodes it is the least possible; on nodes of 3, 3
# and 2 ranks the third network port of each big node stays idle, so the others carry more than the least (and the
# ranks of the big nodes send more inside them than a ring all-reduce would).
# EXPECT FAIL: hierarchical

# ANSWER: hierarchical
def hierarchical_all_reduce(x: torch.Tensor, nodes: list[list[int]]) -> torch.Tensor:
    r = dist.get_rank()
    g = next(i for i, node in enumerate(nodes) if r in node)
    node, G, M = nodes[g], len(nodes), min(len(n) for n in nodes)
    l = node.index(r)
    segments = [s.clone() for s in x.tensor_split(M)]
    L, me = len(node), node.index(r)
    right, left = node[(me + 1) % L], node[(me - 1) % L]
    owner = lambda i: i  # segment i belongs to local rank i (ranks M.. own none)

    def step(send, recv, add):
        """One step round the node: send segment `send` (None: nothing), receive segment `recv` (None: nothing)."""
        works, incoming = [], None
        if send is not None:
            works.append(comm.isend(segments[send], right))
        if recv is not None:
            incoming = torch.empty_like(segments[recv])
            works.append(comm.irecv(incoming, left))
        comm.wait_all(works)
        if recv is not None:
            segments[recv] = segments[recv] + incoming if add else incoming

    # Reduce-scatter round the node: segment i starts at local rank i+1 and ends on local rank i after L-1 hops.
    for s in range(L - 1):
        send = next((i for i in range(M) if (i + 1 + s) % L == me), None)
        recv = next((i for i in range(M) if (i + 2 + s) % L == me), None)
        step(send, recv, add=True)
    if l < M:  # across the nodes: a ring all-reduce of segment l over local rank l of every node
        across = [n[l] for n in nodes]
        pieces = [p.clone() for p in segments[l].tensor_split(G)]
        right_a, left_a = across[(g + 1) % G], across[(g - 1) % G]
        for s in range(G - 1):
            send, recv = (g - 1 - s) % G, (g - 2 - s) % G
            incoming = torch.empty_like(pieces[recv])
            comm.wait_all([comm.isend(pieces[send], right_a), comm.irecv(incoming, left_a)])
            pieces[recv] += incoming
        for s in range(G - 1):
            send, recv = (g - s) % G, (g - 1 - s) % G
            incoming = torch.empty_like(pieces[recv])
            comm.wait_all([comm.isend(pieces[send], right_a), comm.irecv(incoming, left_a)])
            pieces[recv] = incoming
        segments[l] = torch.cat(pieces)
    # All-gather round the node: segment i finished on local rank i, passed on L-1 hops.
    for s in range(L - 1):
        send = next((i for i in range(M) if (i + s) % L == me), None)
        recv = next((i for i in range(M) if (i + 1 + s) % L == me), None)
        step(send, recv, add=False)
    return torch.cat(segments)
