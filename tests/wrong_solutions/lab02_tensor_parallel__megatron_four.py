# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# counts the layer as lesson 02 counts a tensor-parallel layer, four all-reduces of the whole [B, T, H] (g behind
# attention and MLP, f in front of each), plus the K/V sync. On the wire that is what the all-gathers and
# reduce-scatters of a sequence-parallel layer send when T divides by P, but the layout is uneven (blocks padded
# to 3 tokens, not 2.5), an all-gather's contribution is one block, and the RMSNorm gains, which now see only their
# rank's tokens, need a sync too.
# EXPECT FAIL: layer_bytes

# PREDICT: layer_bytes
activation = LAYER_BATCH * LAYER_CFG.seq_len * LAYER_CFG.hidden * 8
kv_sync = 2 * LAYER_CFG.head_size * LAYER_CFG.hidden * 8
payload_bytes = 4 * activation + kv_sync
wire_bytes = 2 * (P - 1) / P * 4 * activation + kv_sync
