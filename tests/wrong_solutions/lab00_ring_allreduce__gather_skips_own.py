# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The slip: in the all-gather too, a rank is taken to send every piece but its own. It sends its own
# first (they are finished there) and never the next rank's: the ring's all-gather ends on it. The ring is right (the
# rule for choosing the ends of a node does not change), the count is not.
# EXPECT FAIL: cross_node_bytes

# PREDICT: cross_node_bytes
sizes, owner = checks.CROSS_SIZES, checks.CROSS_OWNER
owned = [sum(n for n, o in zip(sizes, owner) if o == q) for q in range(8)]
ring = [0, 6, 3, 4, 1, 7, 2, 5]
fewest = 8 * sum(2 * (sum(sizes) - owned[a]) for a in (3, 7, 5))
