# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the prediction forgets that a query sees its own key:
# the token at position t is counted with t keys instead of t + 1. Off by the busiest rank's token count only, which
# a tolerance of a few percent once let through; the count is an integer and is checked exactly.
# EXPECT FAIL: work

# PREDICT: work
T, P, B, nkv, hd = 42, 8, 1, 2, 8
tokens = [len(range(j, T, P)) for j in range(P)]
pairs_busiest = max(sum(t for t in range(j, T, P)) for j in range(P))  # the bug: t keys, not t + 1
token_bytes = 2 * B * nkv * hd * 8
to_right = [sum(tokens[(r - s) % P] for s in range(P // 2)) for r in range(P)]
to_left = [sum(tokens[(r + s) % P] for s in range((P - 1) // 2)) for r in range(P)]
bytes_busiest = max(to_right[r] + to_left[r] for r in range(P)) * token_bytes
bytes_link = max(to_right + to_left) * token_bytes
