# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: a greedy plan, the largest units kept first while they fit. It always fits, and it is often
# optimal, but not here: with the lab model at 300,000 bytes it keeps one SwiGLU matrix where two q/o matrices would
# have filled the room exactly; Llama-3-8B keeps both 525M-parameter embeddings and too few layers.
# EXPECT FAIL: budget

# ANSWER: budget
def plan_offload(numels, N, b_c, b_m, device_budget):
    shards = [math.ceil(n / N) for n in numels]
    room = device_budget - b_c * N * sum(shards)
    if room < 0:
        raise ValueError("the parameters do not fit")
    places, kept = ["host"] * len(shards), 0
    for k in sorted(range(len(shards)), key=lambda k: -shards[k]):
        if 4 * b_m * (kept + shards[k]) <= room:
            places[k], kept = "device", kept + shards[k]
    return places
