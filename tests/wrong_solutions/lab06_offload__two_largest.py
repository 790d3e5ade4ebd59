# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the textbook's staging for an overlap, two buffers of the largest offloaded shard, taken for
# the smallest area. An order of the moments in which no two of the largest shards meet needs less.
# EXPECT FAIL: offload_bytes

# PREDICT: offload_bytes
N, b_m = 3, 8
shard = {name: math.ceil(p.numel() / N) for name, p in build_lab_model(LabConfig()).named_parameters()}
offloaded = [S_u for name, S_u in shard.items() if ".attn.k." not in name and ".attn.v." not in name]
P = 2 * max(offloaded)
staging_bytes = b_m * P
host_bytes = b_m * (3 * sum(offloaded) + P)
