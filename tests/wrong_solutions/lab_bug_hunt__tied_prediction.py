# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: the prediction counts
# the model as Llama's smaller models are built, the head tied to the embedding (one V x H matrix, not two), and
# puts the RMSNorm gains into the shards: the shard and the padding are off; the handed-out norm is right.
# EXPECT FAIL: clip_at_scale

# PREDICT: clip_at_scale
V, H, nq, nkv, F_, L, N = 128256, 4096, 32, 8, 14336, 32, 96
hd = H // nq
matrices = V * H + L * (2 * H * H + 2 * nkv * hd * H + 3 * F_ * H) + (2 * L + 1) * H
shard = math.ceil(matrices / N)
padding = N * shard - matrices
handout_norm = math.sqrt(3.0**2 + N * 0.25**2)
