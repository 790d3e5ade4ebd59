# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# counts the regions' all-gathers and reduce-scatters on padded blocks and the K/V sync right, but not the RMSNorm
# gains' sync. In a tensor-parallel layer the gains need none (every rank normalises every token); in Megatron-SP
# form each rank normalises only its own tokens, so each gain's gradient is a partial sum over the ranks.
# EXPECT FAIL: layer_bytes

# PREDICT: layer_bytes
e = LAYER_CFG.dtype_bytes
block = LAYER_BATCH * max(len(tokens) for tokens in LAYER_LAYOUT) * LAYER_CFG.hidden * e
kv_sync = 2 * LAYER_CFG.head_size * LAYER_CFG.hidden * e
m = P // LAYER_CFG.kv_heads
payload_bytes = 4 * block + 4 * P * block + kv_sync
wire_bytes = 8 * (P - 1) * block + 2 * (m - 1) / m * kv_sync
