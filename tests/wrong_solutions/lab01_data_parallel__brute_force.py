# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: every split is tried (each choice of P - 1 cut points among the B - 1 gaps). Right on every
# small batch, but 64 rows on 8 ranks have 553,270,671 splits: no answer comes within the check's 10 s.
# EXPECT FAIL: shard

# ANSWER: shard
import itertools


def shard_rows(tokens: list[int], world_size: int) -> list[int]:
    B, P = len(tokens), world_size
    if B < P:
        raise ValueError(f"{B} rows cannot give each of {P} ranks a row")
    prefix = list(itertools.accumulate(tokens, initial=0))
    best, best_cuts = None, None
    for cuts in itertools.combinations(range(1, B), P - 1):
        edges = (0, *cuts, B)
        busiest = max(prefix[b] - prefix[a] for a, b in zip(edges, edges[1:]))
        if best is None or busiest < best:
            best, best_cuts = busiest, edges
    return [b - a for a, b in zip(best_cuts, best_cuts[1:])]
