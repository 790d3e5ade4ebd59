# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the axes
# ranked by the step check's payloads (8 rows: dp's gradients outweigh tp's activations) while the prediction is
# for 16 rows, where tp hands over more. The placement then keeps the dp pairs on a node, as the row-major mesh does
# here, and the placed bytes come out equal to the naive ones.
# EXPECT FAIL: traffic

# PREDICT: traffic
rows, H, T, hd, e = 16, CFG.hidden, CFG.seq_len, CFG.head_size, 8
message = rows // 2 * T * H * e  # one [b, T, H]: the batch is split over dp only; tp partners see the same rows
tp_step = 2 * 4 * message  # 2 blocks a stage, each g forward and f backward, of attention and of the MLP
kv_step = 2 * 2 * hd * H * e  # K/V head 1 is on both tp places: its K and V rows, in each of the 2 blocks
per_block = 2 * H + 2 * 6 * hd * H + 2 * 2 * hd * H + 3 * CFG.ffn // 2 * H  # gains; q, o; k, v; gate, up, down
dp_step = 2 * per_block * e  # a stage's gradients, all-reduced over dp
# Row-major over 4 cyclic nodes: node 0 holds ranks 0 and 4, a dp pair; their tp (1, 5) and pp (2, 6) partners
# are elsewhere.
naive_bytes = 2 * (tp_step + kv_step + message)
# dp hands over the most (as in the step's check): a node of 2 keeps a dp pair; tp and the stages cross.
placed_bytes = 2 * (tp_step + kv_step + message)
