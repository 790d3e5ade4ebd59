# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: the prediction slices
# the K/V matrices over the 16 tensor-parallel ranks like every other matrix, as Megatron does when there are at least
# as many K/V heads as ranks; with 8 K/V heads on 16 ranks each rank holds a whole K/V head, held by two ranks. The
# shard is too small, and the handed-out sum counts the K/V numbers once per replica instead of twice.
# EXPECT FAIL: clip_at_scale

# PREDICT: clip_at_scale
V, H, nq, nkv, F_, L, N, tp, G = 128256, 4096, 32, 8, 14336, 32, 640, 16, 10
hd = H // nq
matrices = (2 * V * H + L * (2 * H * H + 2 * nkv * hd * H + 3 * F_ * H)) // tp
shard = math.ceil(matrices / G)
padding = G * shard - matrices
replicas = N // (tp * G)
handout_norm = math.sqrt(replicas * 3.0**2 + replicas * 1.0**2 + N * 0.25**2)
