# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). Issue 40: the padding forgotten. Each unit's shard is taken as Psi_u / N numbers instead of
# S_u = ceil(Psi_u / N), with the right order of the moments: the worst pair needs 2048/3 + 1024/3 numbers, one less
# than the padded shards do; an exact quantity gets an exact check.
# EXPECT FAIL: offload_bytes

# PREDICT: offload_bytes
N, b_m = 3, 8
numel = {name: p.numel() for name, p in build_lab_model(LabConfig()).named_parameters()}
offloaded = [n / N for name, n in numel.items() if ".attn.k." not in name and ".attn.v." not in name]
P = max(offloaded) + 1024 / N
staging_bytes = b_m * P
host_bytes = b_m * (3 * sum(offloaded) + P)
