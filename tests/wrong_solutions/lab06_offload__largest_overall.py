# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the two staging buffers sized by the largest shard of all (683 numbers, a 2048-parameter
# matrix) instead of the largest OFFLOADED one (342, q and o): the matrices of 2048 parameters stay on the device in
# this placement, so their gradients never pass through the host. The device and moved bytes are right.
# EXPECT FAIL: offload_bytes

# PREDICT: offload_bytes
N, b_c, b_m = 3, 4, 8
numel = {name: p.numel() for name, p in build_lab_model(LabConfig()).named_parameters()}
shard = {name: math.ceil(n / N) for name, n in numel.items()}
kept = [name for name in shard if "norm" in name or numel[name] == 2048]
offloaded = [S_u for name, S_u in shard.items() if name not in kept]
device_bytes = b_c * N * sum(shard.values()) + 4 * b_m * sum(shard[name] for name in kept)
host_bytes = b_m * (3 * sum(offloaded) + 2 * max(shard.values()))
moved_bytes = 2 * b_c * sum(offloaded)
