# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the busiest GPU
# taken to be one of the first stage (it holds the embedding, as in the lab's own model where every stage has the
# same blocks). Llama 3's balance gives the first and the last stage one block fewer: a block (400 million numbers
# a GPU) outweighs a slice of the embedding (263 million), and the middle stages are the busiest.
# EXPECT FAIL: memory_at_scale

# PREDICT: memory_at_scale
H, F, V, hd, T = 16384, 53248, 128256, 128, 8
block = 2 * H + 2 * (128 // T * hd) * H + 2 * hd * H + 3 * (F // T) * H  # norms; q, o; k, v (one head); gate, up, down
per_byte = 2 + 2 + 12 / 128  # weights and gradients whole, optimizer states shared out over dp
gb_busiest = (7 * block + V // T * H) * per_byte / 1e9  # the first stage: the embedding's rows
gb_last = (7 * block + V // T * H + H) * per_byte / 1e9  # 7 blocks, its rows of the head, the final norm
