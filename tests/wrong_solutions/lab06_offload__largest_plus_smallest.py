# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the smallest area taken as the largest offloaded shard beside the smallest one, as if a
# small unit could always be put between two large ones. The five RMSNorm gains separate at most six of the eight
# largest shards: some large shard must meet a q or o matrix.
# EXPECT FAIL: offload_bytes

# PREDICT: offload_bytes
N, b_m = 3, 8
shard = {name: math.ceil(p.numel() / N) for name, p in build_lab_model(LabConfig()).named_parameters()}
offloaded = [S_u for name, S_u in shard.items() if ".attn.k." not in name and ".attn.v." not in name]
P = max(offloaded) + min(offloaded)
staging_bytes = b_m * P
host_bytes = b_m * (3 * sum(offloaded) + P)
