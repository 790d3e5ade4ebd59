# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb (tests/test_labs.py grades it; the other answers are the
# solution's). The bug: the merge forgets to rescale. It adds the two outputs as they are, each normalised over its
# own block only, so the weights of the merged softmax sum to 2 instead of 1 (the log-sum-exp itself is right).
# The ring step and the attention layer use this merge, so their outputs are wrong too.
# EXPECT FAIL: merge, ring, layer

# ANSWER: merge
def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a + out_b, lse
