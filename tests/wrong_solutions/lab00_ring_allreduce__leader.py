# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The design: one leader per node (its first rank) gathers the node's sum, the leaders all-reduce it
# round a ring of the nodes, and each leader hands the result back to its node. The sum is right and the bytes between
# the nodes are the least possible; but all of a node's traffic goes through one network port while the others stay
# idle: the busiest port carries L times the least (and a leader of 3 sends more inside its node than a ring would).
# EXPECT FAIL: hierarchical

# ANSWER: hierarchical
def hierarchical_all_reduce(x: torch.Tensor, nodes: list[list[int]]) -> torch.Tensor:
    r = dist.get_rank()
    g = next(i for i, node in enumerate(nodes) if r in node)
    node, leaders = nodes[g], [n[0] for n in nodes]
    if r != node[0]:
        comm.wait_all([comm.isend(x, node[0])])
        out = torch.empty_like(x)
        comm.wait_all([comm.irecv(out, node[0])])
        return out
    total = x.clone()
    for q in node[1:]:
        incoming = torch.empty_like(x)
        comm.wait_all([comm.irecv(incoming, q)])
        total += incoming
    G = len(nodes)
    pieces = [p.clone() for p in total.tensor_split(G)]
    right, left = leaders[(g + 1) % G], leaders[(g - 1) % G]
    for s in range(G - 1):  # reduce-scatter round the leaders: piece g finished on leader g
        send, recv = (g - 1 - s) % G, (g - 2 - s) % G
        incoming = torch.empty_like(pieces[recv])
        comm.wait_all([comm.isend(pieces[send], right), comm.irecv(incoming, left)])
        pieces[recv] += incoming
    for s in range(G - 1):  # all-gather round the leaders
        send, recv = (g - s) % G, (g - 1 - s) % G
        incoming = torch.empty_like(pieces[recv])
        comm.wait_all([comm.isend(pieces[send], right), comm.irecv(incoming, left)])
        pieces[recv] = incoming
    total = torch.cat(pieces)
    comm.wait_all([comm.isend(total, q) for q in node[1:]])
    return total
