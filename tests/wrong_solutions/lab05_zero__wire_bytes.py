# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the communication
# prediction counts the bytes a ring puts on the wire, (N-1)/N of each reduce-scatter's input and N-1 times each
# all-gather's contribution, instead of the payload handed to the collectives that the question asks for (each
# reduce-scatter's whole input, this rank's own shard for each all-gather). At N = 2 that is 3 Psi + 4 bytes instead
# of 4 Psi + 4: 25% short. The count of calls is right.
# EXPECT FAIL: zero3_traffic

# PREDICT: zero3_traffic
PSI, RANKS, BLOCKS = 42_784, 2, 3
units = BLOCKS + 4
calls_rank0 = 3 * units + 1
bytes_rank0 = (RANKS - 1) / RANKS * 2 * PSI + 2 * (RANKS - 1) * 2 * PSI / RANKS + (RANKS - 1) / RANKS * 2 * 4
