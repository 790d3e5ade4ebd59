# ruff: noqa
# A wrong answer to labs/lab09_expert_parallel.ipynb (tests/test_labs.py grades it; the other answers are the
# solution's). The bug: the capacity is counted per rank, as in lesson 09's layer, not over the group: every rank
# hands out all C slots of an expert to its own rows, so up to P x C rows reach one expert. The dispatch and the
# combine are right; the kept rows, and so the output, are not one device's.
# EXPECT FAIL: capacity

# ANSWER: capacity
def keep_within_capacity(expert, experts, capacity, group=None):
    onehot = F.one_hot(expert, experts)  # [N, k, E]
    counts = onehot.sum(dim=0)  # [k, E] mine only
    ahead = counts.cumsum(dim=0) - counts  # my own first choices before my second
    mine = onehot.cumsum(dim=0) - onehot
    return (ahead.unsqueeze(0) + mine).gather(2, expert.unsqueeze(2)).squeeze(2) < capacity
