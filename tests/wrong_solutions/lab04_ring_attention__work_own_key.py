# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the prediction forgets that a query sees its own key:
# the token at position t is counted with t keys instead of t + 1. Off by the busiest rank's token count only, which
# a tolerance of a few percent once let through; the count is an integer and is checked exactly.
# EXPECT FAIL: work

# PREDICT: work
T, P, B, nkv, hd = 42, 8, 1, 2, 8
# set pairs_busiest, bytes_total and bytes_link: integers
pairs_busiest = max(sum(t for t in range(j, T, P)) for j in range(P))  # the bug: t keys, not t + 1
layout = [list(range(j * T // P, (j + 1) * T // P)) for j in range(P)]  # contiguous: 5, 5, 5, 6, 5, 5, 5, 6
token_bytes = 2 * B * nkv * hd * 8  # K and V of one token
link = {}  # (sender, way): bytes
for j in range(P):  # block j's path each way; it goes as far as the last rank on it that sees one of its keys
    for d, hops in ((1, P // 2), (-1, (P - 1) // 2)):
        path = [(j + d * t) % P for t in range(1, hops + 1)]
        last = max((h for h, i in enumerate(path) if layout[j][0] <= layout[i][-1]), default=-1)
        for h in range(last + 1):
            sender = (j + d * h) % P
            link[sender, d] = link.get((sender, d), 0) + len(layout[j]) * token_bytes
bytes_total = sum(link.values())
bytes_link = max(link.values())
