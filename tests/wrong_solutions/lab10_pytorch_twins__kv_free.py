# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the prediction
# takes the K/V head, whole on every rank, for free in backward ("replicated: nothing to sum"), and counts only the
# column-parallel Linears' all-reduces. But each rank's gradient of the K/V head is its own query heads' share: it
# must be summed somewhere, once for k and once for v.
# EXPECT FAIL: layer_collectives

# PREDICT: layer_collectives
activation = BATCH * CFG.seq_len * CFG.hidden * 8
forward_all_reduces = 2
backward_all_reduces = 3
payload_bytes = 5 * activation
