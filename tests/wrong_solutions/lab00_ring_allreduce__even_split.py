# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The design: a reduce-scatter inside each node, then each piece (cut at every node's cuts) all-reduced
# round a ring of its G owners, one per node, then an all-gather inside each node. Every node then sends 2(G-1)/G of
# everything, whatever its size: the least on two nodes and on equal nodes, but on nodes of 3, 3 and 2 ranks the node
# of 2 puts as much over 2 ports as the others over 3: its ports carry more than the least possible.
# EXPECT FAIL: hierarchical

# ANSWER: hierarchical
def hierarchical_all_reduce(x: torch.Tensor, nodes: list[list[int]]) -> torch.Tensor:
    """x: [N] on every rank; nodes: the global ranks of each node (any sizes) -> the sum over all ranks, [N]."""
    r, N = dist.get_rank(), x.numel()
    g = next(i for i, node in enumerate(nodes) if r in node)  # this rank's node
    node, l = nodes[g], nodes[g].index(r)  # noqa: E741 (l: the local rank)

    def cuts(L: int) -> list[int]:
        """Where tensor_split(L) cuts [0, N): segment i is [cuts[i], cuts[i+1])."""
        q, extra = divmod(N, L)
        return [i * q + min(i, extra) for i in range(L + 1)]

    def reduce_scatter(pieces: list[torch.Tensor], ring: list[int]) -> None:
        """A ring reduce-scatter over the ranks `ring`: pieces[m] ends summed on ring[m]. In place."""
        M, me = len(ring), ring.index(r)
        for s in range(M - 1):
            send, recv = (me - 1 - s) % M, (me - 2 - s) % M
            incoming = torch.empty_like(pieces[recv])
            comm.wait_all([comm.isend(pieces[send], ring[(me + 1) % M]), comm.irecv(incoming, ring[(me - 1) % M])])
            pieces[recv] += incoming

    def all_gather(pieces: list[torch.Tensor], ring: list[int]) -> None:
        """ring[m] starts with pieces[m] finished; afterwards every member holds every piece. In place."""
        M, me = len(ring), ring.index(r)
        for s in range(M - 1):
            send, recv = (me - s) % M, (me - 1 - s) % M
            incoming = torch.empty_like(pieces[recv])
            comm.wait_all([comm.isend(pieces[send], ring[(me + 1) % M]), comm.irecv(incoming, ring[(me - 1) % M])])
            pieces[recv] = incoming

    # Inside the node first: only sums need to cross, so local rank l sums segment l of L over its node.
    segments = [s.clone() for s in x.tensor_split(len(node))]
    reduce_scatter(segments, node)
    # Across the nodes: every node cuts [0, N) its own way, so cut at every node's cuts. Each piece then lies in one
    # segment of every node and has one owner per node; those G owners all-reduce it (a ring reduce-scatter and
    # all-gather): 2(G-1)/G of the piece leaves each owner, so each node sends 2(G-1)/G N in all, spread over the
    # owners in proportion to their segments. Every rank walks the pieces in the same order: no cycle of waits.
    start, points = cuts(len(node))[l], sorted({c for n in nodes for c in cuts(len(n))})
    for a, b in zip(points, points[1:]):
        owners = [n[max(i for i, c in enumerate(cuts(len(n))) if c <= a)] for n in nodes]  # one rank per node
        if owners[g] != r:
            continue
        parts = [p.clone() for p in segments[l][a - start : b - start].tensor_split(len(nodes))]
        reduce_scatter(parts, owners)
        all_gather(parts, owners)
        segments[l][a - start : b - start] = torch.cat(parts)
    all_gather(segments, node)  # inside the node again: every rank gets every finished segment
    return torch.cat(segments)
