# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). Issue 40: the library's formulas, parlab.schemes.zero.theory.offload_memory. The prediction adds up
# two of its tables (all offloaded, plus the kept units' state): the device and moved bytes come out right, the host
# ones are the library's layout (a full gradient shard, not two staging buffers); the notebook's watch names the call
# either way. The budget's plan takes the parameters' bytes from it: every plan is right, and the check's profile
# hook names the call.
# EXPECT FAIL: offload_bytes, budget

# PREDICT: offload_bytes
from parlab.schemes.zero.theory import offload_memory

numel = {name: p.numel() for name, p in build_lab_model(LabConfig()).named_parameters()}
kept = [n for name, n in numel.items() if "norm" in name or ".attn.k." in name or ".attn.v." in name]
offloaded = [n for name, n in numel.items() if not ("norm" in name or ".attn.k." in name or ".attn.v." in name)]
on_device = offload_memory(kept, 3, "none", 4, 8)["steady"]["device"]
device_bytes = offload_memory(list(numel.values()), 3, "cpu", 4, 8)["steady_total"]["device"]
device_bytes += on_device["grads"] + on_device["optimizer"]
host_bytes = offload_memory(offloaded, 3, "cpu", 4, 8)["steady_total"]["host"]
moved_bytes = 2 * 4 * offload_memory(offloaded, 3, "cpu", 4, 8)["S"]


# ANSWER: budget
from parlab.schemes.zero.theory import offload_memory


def plan_offload(numels, N, b_c, b_m, device_budget):
    shards = [math.ceil(n / N) for n in numels]
    room = device_budget - offload_memory(numels, N, "cpu", b_c, b_m)["steady_total"]["device"]
    if room < 0:
        raise ValueError("the parameters do not fit")
    reachable = {0: []}
    for k, S_u in enumerate(shards):
        for total, units in list(reachable.items()):
            if 4 * b_m * (total + S_u) <= room and total + S_u not in reachable:
                reachable[total + S_u] = units + [k]
    kept = set(reachable[max(reachable)])
    return ["device" if k in kept else "host" for k in range(len(shards))]
