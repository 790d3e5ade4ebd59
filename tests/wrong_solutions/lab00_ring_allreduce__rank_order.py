# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The slip: the ring in rank order taken as it comes, with its count right (every hop of it goes from one
# node to another, so every rank's traffic crosses). A ring over three nodes needs to cross only three times.
# EXPECT FAIL: cross_node_bytes

# PREDICT: cross_node_bytes
sizes, owner = checks.CROSS_SIZES, checks.CROSS_OWNER
owned = [sum(n for n, o in zip(sizes, owner) if o == q) for q in range(8)]
ring = [0, 1, 2, 3, 4, 5, 6, 7]
fewest = 8 * sum(2 * sum(sizes) - owned[a] - owned[(a + 1) % 8] for a in range(8))
