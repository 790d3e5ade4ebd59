# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the prediction of
# the library's template plan (one ColwiseParallel per q, k, v, gate, up: each sums x's gradient, [B, T, H], on its
# own), not of the student's part-1 plan, whose k and v sum their narrow output's gradient instead.
# EXPECT FAIL: layer_collectives

# PREDICT: layer_collectives
activation = BATCH * CFG.seq_len * CFG.hidden * 8
forward_all_reduces = 2
backward_all_reduces = 5
payload_bytes = 7 * activation
