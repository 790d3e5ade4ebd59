# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the parameters counted as
# for multi-head attention, k and v as large as q (32 key/value heads, not 8): Psi is 8.83 billion instead of 8.03,
# 10% too many, and the flat shard with it. The busiest owner is right (the embedding alone).
# EXPECT FAIL: owner_memory

# PREDICT: owner_memory
V, H, LAYERS, HEADS, KV_HEADS, FFN = 128_256, 4096, 32, 32, 8, 14_336
RANKS, K = 64, 12
block = [H, H * H, H * H, H * H, H * H, H, FFN * H, FFN * H, H * FFN]
numels = [V * H, *block * LAYERS, H, V * H]
flat_bytes = K * math.ceil(sum(numels) / RANKS)
owner_bytes = K * V * H
