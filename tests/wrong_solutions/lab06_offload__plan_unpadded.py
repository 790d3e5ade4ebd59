# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the plan counts the compute copy as b_c Psi (no padding) while it pads the state: at N = 2
# the lab model needs no padding and every plan is right; at N = 3 every unit is padded, the parameters take 100
# bytes more than it thinks, so one byte short of them it does not raise, and plans overfill their budgets.
# EXPECT FAIL: budget

# ANSWER: budget
def plan_offload(numels, N, b_c, b_m, device_budget):
    shards = [math.ceil(n / N) for n in numels]
    params = b_c * sum(numels)
    if params > device_budget:
        raise ValueError("the parameters do not fit")
    cap = (device_budget - params) // (4 * b_m)
    reached = {0: None}
    for k, S_u in enumerate(shards):
        for total in list(reached):
            if total + S_u <= cap and total + S_u not in reached:
                reached[total + S_u] = (total, k)
    kept, total = set(), max(reached)
    while reached[total] is not None:
        total, k = reached[total]
        kept.add(k)
    return ["device" if k in kept else "host" for k in range(len(shards))]
