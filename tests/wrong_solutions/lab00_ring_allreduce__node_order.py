# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The slip: the ring in node order as dealt, [0, 3, 6, 1, 4, 7, 2, 5], taken for the best because it
# crosses between nodes only three times, and its count right; but which ranks sit at a node's ends matters: a hop
# leaves out the pieces its two ends own, and rank 6 (a small owner) and rank 1 (another) are at the ends here.
# EXPECT FAIL: cross_node_bytes

# PREDICT: cross_node_bytes
sizes, owner = checks.CROSS_SIZES, checks.CROSS_OWNER
owned = [sum(n for n, o in zip(sizes, owner) if o == q) for q in range(8)]
ring = [0, 3, 6, 1, 4, 7, 2, 5]
fewest = 8 * sum(2 * sum(sizes) - owned[a] - owned[b] for a, b in [(6, 1), (7, 2), (5, 0)])
