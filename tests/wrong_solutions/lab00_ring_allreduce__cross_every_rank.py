# ruff: noqa
# A wrong answer to labs/lab00_ring_allreduce.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The slip: in the flat ring every rank of node 0 is counted as sending its 2(P-1)/P x N to node 1,
# though only the rank whose right neighbour is on node 1 does (the others send inside the node). The two
# hierarchical numbers are right.
# EXPECT FAIL: cross_node_bytes

# PREDICT: cross_node_bytes
flat_cross = 4 * 2 * 7 * 150 * 8
hier_busiest = 2 * 150 * 8
hier_cross = 4 * hier_busiest
