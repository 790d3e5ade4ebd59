# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the least bound is found right (bisection, then a greedy cut), but the
# greedy cut can make fewer blocks than ranks, and the ranks left over get no row. The busiest rank is the least
# possible; a rank with no row has nothing to train on (and, in part 2, no forward to run): [10, 0, 0, 5, 5] on 3
# ranks gives [3, 2, 0].
# EXPECT FAIL: shard

# ANSWER: shard
def shard_rows(tokens: list[int], world_size: int) -> list[int]:
    B, P = len(tokens), world_size
    if B < P:
        raise ValueError(f"{B} rows cannot give each of {P} ranks a row")

    def blocks(bound):
        counts, load = [0], 0
        for t in tokens:
            if counts[-1] and load + t > bound:
                counts.append(0)
                load = 0
            counts[-1] += 1
            load += t
        return counts

    low, high = max(tokens), sum(tokens)
    while low < high:
        middle = (low + high) // 2
        if len(blocks(middle)) <= P:
            high = middle
        else:
            low = middle + 1
    counts = blocks(low)
    return counts + [0] * (P - len(counts))  # the ranks left over: nothing
