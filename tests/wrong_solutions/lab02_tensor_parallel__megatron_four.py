# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the prediction
# counts Megatron's four all-reduces of [B, T, H] per layer (g behind attention and MLP, f in front of each), the
# lesson's count for a GPT with one K/V head per query head, and forgets the sync of the K/V gradients that the
# lab model needs when nkv < P.
# EXPECT FAIL: layer_bytes

# PREDICT: layer_bytes
activation = LAYER_BATCH * LAYER_CFG.seq_len * LAYER_CFG.hidden * 8
payload_bytes = 4 * activation
wire_bytes = 2 * (P - 1) / P * payload_bytes
