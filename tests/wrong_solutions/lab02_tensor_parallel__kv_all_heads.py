# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (the data-parallel
# route): every rank keeps all the K/V heads, uses the one its query heads read, and all-reduces the whole k and v
# gradients over all ranks, as data-parallel replicas do. The numbers are exact (a head's gradient is zero on the ranks
# that do not read it), but each rank holds nkv hd rows of k and of v where hd suffice, and the sync hands over
# 2 nkv hd H numbers: twice the budget where nkv=2.
# EXPECT FAIL: gqa

# ANSWER: gqa
class GQAttentionTP(nn.Module):
    def __init__(self, full, enter, leave):
        super().__init__()
        cfg = self.cfg = full.cfg
        self.enter, self.leave = enter, leave
        r, ranks = dist.get_rank(), dist.get_world_size()
        hd, per_rank = cfg.head_size, cfg.heads // ranks
        first = r * per_rank
        self.kv_head = first // cfg.group_size

        def linear(weight):
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            layer.weight = nn.Parameter(weight.detach().clone())
            return layer

        mine = slice(first * hd, (first + per_rank) * hd)
        self.q = linear(full.q.weight[mine])
        self.k = linear(full.k.weight)  # every K/V head
        self.v = linear(full.v.weight)
        self.o = linear(full.o.weight[:, mine])

    def forward(self, x, positions, docs):
        x = self.enter(x)
        B, T, _ = x.shape
        hd, j = self.cfg.head_size, self.kv_head

        def heads(t):
            return t.view(B, T, -1, hd).transpose(1, 2)

        q = apply_rope(heads(self.q(x)), positions, self.cfg.rope_base)
        k = apply_rope(heads(self.k(x))[:, j : j + 1], positions, self.cfg.rope_base)
        seen = (docs[:, None] == docs[None, :]) & (positions[None, :] <= positions[:, None])
        scores = (q @ k.transpose(-2, -1) / hd**0.5).masked_fill(~seen, float("-inf"))
        y = scores.softmax(dim=-1) @ heads(self.v(x))[:, j : j + 1]
        return self.leave(self.o(y.transpose(1, 2).reshape(B, T, -1)))

    def sync_grads(self):
        for weight in (self.k.weight, self.v.weight):
            comm.all_reduce(weight.grad)
