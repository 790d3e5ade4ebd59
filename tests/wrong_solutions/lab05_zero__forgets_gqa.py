# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the parameters counted as
# for multi-head attention, k and v as large as q (32 key/value heads, not 8): Psi is 8.83 billion instead of 8.03,
# 10% too many, the flat shard with it, and more ranks before the busiest owner stops falling. The busiest owner on
# 64 ranks is right (the embedding alone).
# EXPECT FAIL: owner_memory

# PREDICT: owner_memory
V, H, LAYERS, HEADS, KV_HEADS, FFN = 128_256, 4096, 32, 32, 8, 14_336  # vocabulary, hidden, blocks, heads, F
RANKS, K = 64, 12
hd = H // HEADS  # the head size
block = [
    H,
    H * H,
    H * H,
    H * H,
    H * H,
    H,
    FFN * H,
    FFN * H,
    H * FFN,
]  # k and v as large as q  # norm q k v o norm g u d
numels = [V * H, *block * LAYERS, H, V * H]  # embed, the blocks, the final norm, the LM head
flat_bytes = K * math.ceil(sum(numels) / RANKS)
# No assignment gives a rank less than a whole tensor it owns, and some rank owns the largest: that is the floor.
# On 64 ranks the average load is far below it, and the other tensors fit on the other ranks.
owner_bytes = K * max(numels)
# Below Psi / largest ranks the average load, hence the busiest, is above the floor. From there on the embedding and
# the head each fill a rank, and the blocks' tensors (each far smaller than the room left on the other ranks) pack
# into the rest: largest first to the least loaded rank leaves none above the floor (checked below).
floor_ranks = math.ceil(sum(numels) / max(numels))
loads = [0] * floor_ranks
for n in sorted(numels, reverse=True):
    loads[loads.index(min(loads))] += n
assert max(loads) == max(numels)
