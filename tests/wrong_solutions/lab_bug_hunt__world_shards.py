# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: the prediction shards
# the matrices over all 384 ranks, as ZeRO over every rank would, not over a shard group of 96; and takes the
# handed-out norm to count only the gains too often (each of the 384 ranks adds them), not the matrices, each of
# whose shards 4 ranks hold: all three numbers are off.
# EXPECT FAIL: clip_at_scale

# PREDICT: clip_at_scale
V, H, nq, nkv, F_, L, N = 128256, 4096, 32, 8, 14336, 32, 384
hd = H // nq
matrices = 2 * V * H + L * (2 * H * H + 2 * nkv * hd * H + 3 * F_ * H)
shard = math.ceil(matrices / N)
padding = N * shard - matrices
handout_norm = math.sqrt(3.0**2 + N * 0.25**2)
