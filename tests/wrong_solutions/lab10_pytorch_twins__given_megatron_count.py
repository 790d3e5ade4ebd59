# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the prediction
# counts Megatron's f for the given plan's backward, one all-reduce of x's gradient per sub-layer. But the given plan
# has a style per column-parallel Linear and nothing on the sub-layers' inputs: q, k, v, gate and up each turned the
# same plain x into a DTensor of its own, and each sums its gradient alone.
# EXPECT FAIL: layer_collectives

# PREDICT: layer_collectives
activation = BATCH * CFG.seq_len * CFG.hidden * 8
piece = activation // P
forward_collectives = 4
backward_all_reduces = 2
backward_all_gathers = 2
payload_bytes = 2 * (activation + piece) + 2 * activation + 2 * piece
