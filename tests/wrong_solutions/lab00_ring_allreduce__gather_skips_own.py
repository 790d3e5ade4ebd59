# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The slip: in the all-gather too, a rank is taken to send every chunk but its own. It sends its own
# first (it is the one finished there) and never the next rank's: the ring's all-gather ends on it. With chunks of
# 151 and 150 values that changes the count: which chunk a rank leaves out matters, not only how many.
# EXPECT FAIL: cross_node_bytes

# PREDICT: cross_node_bytes
sizes = [151, 151, 151, 150, 150, 150, 150, 150]
rank_order = sum(2 * (1203 - sizes[r]) * 8 for r in (0, 2, 4, 6))
ring = [2, 4, 6, 0, 1, 3, 5, 7]
fewest = 2 * (1203 - sizes[0]) * 8
