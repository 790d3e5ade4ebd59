# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the prediction
# takes the given plan's backward for the mirror of its forward with the reduce-scatter's inverse free, as if the
# gradient could stay a sum owed by the ranks: only the column-parallel Linears' all-reduces in backward. But a
# redistribution hands a Partial's gradient back whole: the reduce-scatter's inverse is an all-gather.
# EXPECT FAIL: layer_collectives

# PREDICT: layer_collectives
activation = BATCH * CFG.seq_len * CFG.hidden * 8
piece = activation // P
forward_collectives = 4
backward_all_reduces = 5
backward_all_gathers = 0
payload_bytes = 2 * (activation + piece) + 5 * activation
