# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the
# prediction has the x block and the partial sum of the same rank skip a link (2 (T - n) for the rank with the
# fewest tokens): but the x block that does not cross a link is the one of the rank it leads to, the partial sum
# the one of the rank it leaves. The Megatron-SP number is right.
# EXPECT FAIL: layer_bytes

# PREDICT: layer_bytes
e = RING_CFG.dtype_bytes
link_bytes = RING_BATCH * RING_CFG.hidden * e * 2 * (sum(RING_COUNTS) - min(RING_COUNTS))
padded_link_bytes = 2 * (RING_P - 1) * RING_BATCH * max(RING_COUNTS) * RING_CFG.hidden * e
