# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The slip: the ring in node order, [0, 2, 4, 6, 1, 3, 5, 7], taken for the best because it crosses from
# node 0 to node 1 only once, and its count right; but the one crossing, 6 -> 1, leaves out chunks of 150 and 151,
# while a crossing 0 -> 1 (or 2 -> 1) leaves out two of 151: node 0 sends 8 bytes fewer.
# EXPECT FAIL: cross_node_bytes

# PREDICT: cross_node_bytes
sizes = [151, 151, 151, 150, 150, 150, 150, 150]
rank_order = sum((2 * 1203 - sizes[r] - sizes[r + 1]) * 8 for r in (0, 2, 4, 6))
ring = [0, 2, 4, 6, 1, 3, 5, 7]
fewest = (2 * 1203 - sizes[6] - sizes[1]) * 8
