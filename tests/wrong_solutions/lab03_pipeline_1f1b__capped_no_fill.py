# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the prediction
# counts m / k round trips of p (F + B) and forgets that the k micro-batches of a round cannot enter together (they
# queue at the last stage, F + B each): it predicts the limit 1 - k/p of a long step, 0.625 instead of 7/11 = 0.636.
# EXPECT FAIL: capped_bubble

# PREDICT: capped_bubble
p, m, k = 8, 24, 3
bubble = 1 - m / (p * m / k)
