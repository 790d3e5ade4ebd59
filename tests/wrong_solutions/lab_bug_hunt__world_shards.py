# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: the prediction shards
# each rank's slices over all 40 ranks of its data-parallel dimension, as ZeRO over every replica would, not over a
# shard group of 10; and takes the handed-out sum to count only the gains too often (each of the 640 ranks adds
# them), not the matrices, each of whose shards 4 ranks hold: all three numbers are off.
# EXPECT FAIL: clip_at_scale

# PREDICT: clip_at_scale
V, H, nq, nkv, F_, L, N, tp = 128256, 4096, 32, 8, 14336, 32, 640, 16
hd = H // nq
matrices = (2 * V * H + L * (2 * H * H + 3 * F_ * H)) // tp + L * 2 * hd * H
shard = math.ceil(matrices / (N // tp))
padding = N // tp * shard - matrices
handout_norm = math.sqrt(3.0**2 + 1.0**2 + N * 0.25**2)
