# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the prediction
# takes Megatron's count for torch's: f mirrors g, so two all-reduces per layer each way. But a plan with one style
# per Linear pays one all-reduce in backward for each column-parallel Linear (q, k, v, gate, up): each turned the
# same x into a DTensor of its own.
# EXPECT FAIL: layer_collectives

# PREDICT: layer_collectives
activation = BATCH * CFG.seq_len * CFG.hidden * 8
forward_all_reduces = 2
backward_all_reduces = 2
payload_bytes = 4 * activation
