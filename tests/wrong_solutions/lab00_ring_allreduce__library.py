# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The cheat: the all-reduce across nodes built from the library's ring (parlab.schemes.collectives,
# lesson 00's), run on a process group per node, then on one group per local rank across the nodes. The sum is right
# on equal nodes; the check names the library call, and the whole tensor crosses between the nodes on every rank
# (L times the least bytes); on nodes of 3 and 2 ranks the third rank of the larger node has no group to cross in.
# EXPECT FAIL: hierarchical

# ANSWER: hierarchical
def hierarchical_all_reduce(x: torch.Tensor, nodes: list[list[int]]) -> torch.Tensor:
    from parlab.schemes.collectives import ring_all_reduce

    r = dist.get_rank()
    inside = [dist.new_group(node) for node in nodes]  # every rank makes every group, in the same order
    across = [dist.new_group([node[l] for node in nodes if l < len(node)]) for l in range(max(map(len, nodes)))]
    g = next(i for i, node in enumerate(nodes) if r in node)
    y = ring_all_reduce(x, group=inside[g])
    return ring_all_reduce(y, group=across[nodes[g].index(r)])
