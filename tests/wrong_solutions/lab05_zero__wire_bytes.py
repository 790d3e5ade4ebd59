# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the communication
# prediction counts the bytes a ring puts on the wire, (N-1)/N of each reduce-scatter's input and of each all-gather's
# output, instead of the payload handed to the collectives that the question asks for (each reduce-scatter's whole
# input, this rank's own shard for each all-gather). At N = 2 that is 2/3 of the payload. The memory is right.
# EXPECT FAIL: zero2_budget

# ANSWER: zero2_budget
PSI, RANKS = 42_784, 2
bytes_rank0 = 2 * (RANKS - 1) / RANKS * 2 * PSI
held_rank0 = 2 * PSI + (2 + 12) * PSI / RANKS
