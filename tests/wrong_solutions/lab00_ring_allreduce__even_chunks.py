# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The slip: every chunk counted as 1203 // 8 = 150 values, though tensor_split makes the first three
# 151. The crossings are counted right (every hop of the rank-order ring, one hop of the ring in node order, the order
# chosen) and so is what a crossing rank sends (every chunk but one in each phase); the sizes of the chunks it
# leaves out are not, and with equal chunks any one crossing looks as good as another.
# EXPECT FAIL: cross_node_bytes

# PREDICT: cross_node_bytes
chunk = 1203 // 8
rank_order = 4 * 2 * 7 * chunk * 8
ring = [0, 2, 4, 6, 1, 3, 5, 7]
fewest = 2 * 7 * chunk * 8
