# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). Issue 40: the padding forgotten. Each unit's shard is taken as Psi_u / N numbers instead of
# S_u = ceil(Psi_u / N): off by less than 0.2%, which a 5% tolerance let through; an exact quantity gets an exact check.
# EXPECT FAIL: offload_bytes

# PREDICT: offload_bytes
N, b_c, b_m = 3, 4, 8
numel = {name: p.numel() for name, p in build_lab_model(LabConfig()).named_parameters()}
kept = [name for name in numel if "norm" in name or numel[name] == 2048]
offloaded = [n / N for name, n in numel.items() if name not in kept]
device_bytes = b_c * sum(numel.values()) + 4 * b_m * sum(numel[name] for name in kept) / N
host_bytes = b_m * (3 * sum(offloaded) + 2 * max(offloaded))
moved_bytes = 2 * b_c * sum(offloaded)
