# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: each rank takes rows until it would pass the average (the whole batch's
# tokens / P), leaving a row for every rank after it. A reasonable guess, and right on most batches, but not
# the least busiest rank: on tokens [6, 2, 0, 4, 9, 8, 13, 7] over 4 ranks it splits 4, 1, 1, 2 (busiest 20);
# 3, 2, 2, 1 holds at most 17.
# EXPECT FAIL: shard

# ANSWER: shard
def shard_rows(tokens: list[int], world_size: int) -> list[int]:
    B, P = len(tokens), world_size
    if B < P:
        raise ValueError(f"{B} rows cannot give each of {P} ranks a row")
    target = -(-sum(tokens) // P)  # the average, rounded up
    counts, i = [], 0
    for r in range(P):
        left = P - r - 1  # ranks after this one, each needs a row
        c, load = 0, 0
        while i + c < B - left and (c == 0 or load + tokens[i + c] <= target):
            load += tokens[i + c]
            c += 1
        if r == P - 1:
            c = B - i
        counts.append(c)
        i += c
    return counts
