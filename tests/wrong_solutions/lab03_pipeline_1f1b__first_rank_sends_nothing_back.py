# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the prediction
# reasons per rank instead of per stage: "rank 0 is the first rank, so it sends no gradients". But rank 0 also holds
# stage 4, whose backwards send gradients to stage 3 on rank 3; only stage 0 has no one to send back to.
# EXPECT FAIL: traffic

# ANSWER: traffic
message = 1 * 8 * 16 * 8
bytes_rank0 = 2 * 8 * message
bytes_rank1 = 4 * 8 * message
