# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the
# prediction counts every x block and every partial sum over every link (2 T tokens' worth), forgetting that each
# needs only P - 1 of the P links of the ring: which one each skips decides the busiest link. The Megatron-SP
# number is right.
# EXPECT FAIL: layer_bytes

# PREDICT: layer_bytes
e = RING_CFG.dtype_bytes
link_bytes = RING_BATCH * RING_CFG.hidden * e * 2 * sum(RING_COUNTS)
padded_link_bytes = 2 * (RING_P - 1) * RING_BATCH * max(RING_COUNTS) * RING_CFG.hidden * e
