# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The design: the textbook 2D all-reduce, which assumes every node has as many ranks: a reduce-scatter
# inside each node (local rank l ends with chunk l of L), a ring all-reduce of chunk l over the ranks of local rank l
# of every node, an all-gather inside each node. Right and optimal on equal nodes; on nodes of 3 and 2 ranks the
# larger node cuts the tensor in three and the smaller in two, and local rank 2 has no partner: the run fails.
# EXPECT FAIL: hierarchical

# ANSWER: hierarchical
def hierarchical_all_reduce(x: torch.Tensor, nodes: list[list[int]]) -> torch.Tensor:
    r = dist.get_rank()
    g = next(i for i, node in enumerate(nodes) if r in node)
    node, G = nodes[g], len(nodes)
    l = node.index(r)
    across = [other[l] for other in nodes]

    def reduce_scatter(pieces, ring, me):
        M = len(ring)
        right, left = ring[(me + 1) % M], ring[(me - 1) % M]
        for s in range(M - 1):
            send, recv = (me - 1 - s) % M, (me - 2 - s) % M
            incoming = torch.empty_like(pieces[recv])
            comm.wait_all([comm.isend(pieces[send], right), comm.irecv(incoming, left)])
            pieces[recv] += incoming

    def all_gather(pieces, ring, me):
        M = len(ring)
        right, left = ring[(me + 1) % M], ring[(me - 1) % M]
        for s in range(M - 1):
            send, recv = (me - s) % M, (me - 1 - s) % M
            incoming = torch.empty_like(pieces[recv])
            comm.wait_all([comm.isend(pieces[send], right), comm.irecv(incoming, left)])
            pieces[recv] = incoming

    chunks = [c.clone() for c in x.tensor_split(len(node))]
    reduce_scatter(chunks, node, l)
    pieces = [p.clone() for p in chunks[l].tensor_split(G)]
    reduce_scatter(pieces, across, g)
    all_gather(pieces, across, g)
    chunks[l] = torch.cat(pieces)
    all_gather(chunks, node, l)
    return torch.cat(chunks)
