# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the
# prediction counts only the forward's all-reduces (g after attention and after the MLP) and forgets f's two in
# backward, so both numbers are half the theory.
# EXPECT FAIL: layer_bytes

# ANSWER: layer_bytes
activation = BATCH * T * H * 8
payload_bytes = 2 * activation
wire_bytes = 2 * (P - 1) / P * payload_bytes
