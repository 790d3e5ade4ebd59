# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb. The bug: the merge follows the formula literally, forming each
# block's total weight exp(lse) and dividing by their sum. Right for ordinary scores (the ring and the layer pass),
# but with scores in the thousands exp(lse) is inf in float64 (inf / inf: NaN), and a row that saw no key in
# either block divides 0 by 0.
# EXPECT FAIL: merge

# ANSWER: merge
def merge(out_a, lse_a, out_b, lse_b):
    weight_a, weight_b = torch.exp(lse_a), torch.exp(lse_b)  # [..., Tq]: each block's total softmax weight
    total = weight_a + weight_b
    out = (weight_a / total).unsqueeze(-1) * out_a + (weight_b / total).unsqueeze(-1) * out_b
    return out, torch.log(total)
