# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: the plan counts the device's parameters as one slice per rank (b_c S, ZeRO-3's view) instead of the
# whole compute copy ZeRO-2 keeps on every rank (b_c N S). With N > 1 it keeps too much state on the device: this
# lab's plan does not fit its budget, and neither do the plans for N = 4; the one-byte-short budget does not raise.
# EXPECT FAIL: budget

# ANSWER: budget
def plan_offload(numels, N, b_c, b_m, device_budget):
    shards = [math.ceil(n / N) for n in numels]
    params = b_c * sum(shards)
    if params > device_budget:
        raise ValueError("the parameters do not fit")
    room, best, kept_most = device_budget - params, None, -1
    for keep in itertools.product((True, False), repeat=len(shards)):
        kept = sum(s for s, stays in zip(shards, keep) if stays)
        if 4 * b_m * kept <= room and kept > kept_most:
            best, kept_most = keep, kept
    return ["device" if stays else "host" for stays in best]
