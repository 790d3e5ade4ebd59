# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the plan counts the device's parameters as one slice per rank (b_c S, ZeRO-3's view) instead
# of the whole compute copy ZeRO-2 keeps on every rank (b_c N S). With N > 1 it keeps too much state on the device:
# the plans do not fit their budgets, and the one-byte-short budget does not raise.
# EXPECT FAIL: budget

# ANSWER: budget
def plan_offload(numels, N, b_c, b_m, device_budget):
    shards = [math.ceil(n / N) for n in numels]
    room = device_budget - b_c * sum(shards)
    if room < 0:
        raise ValueError("the parameters do not fit")
    reachable = {0: []}
    for k, S_u in enumerate(shards):
        for total, units in list(reachable.items()):
            if 4 * b_m * (total + S_u) <= room and total + S_u not in reachable:
                reachable[total + S_u] = units + [k]
    kept = set(reachable[max(reachable)])
    return ["device" if k in kept else "host" for k in range(len(shards))]
