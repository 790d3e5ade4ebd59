# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the copies of a
# K/V head are averaged over the ranks that share it, as data-parallel replicas' gradients are. But these copies saw
# the same batch through different query heads: each holds a *part* of the head's gradient, and the whole is their
# sum. The groups and the traffic are right; the K/V gradients are m times too small.
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
        kv_head = first // cfg.group_size

        def linear(weight):
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            layer.weight = nn.Parameter(weight.detach().clone())
            return layer

        mine = slice(first * hd, (first + per_rank) * hd)
        self.q = linear(full.q.weight[mine])
        self.k = linear(full.k.weight[kv_head * hd : (kv_head + 1) * hd])
        self.v = linear(full.v.weight[kv_head * hd : (kv_head + 1) * hd])
        self.o = linear(full.o.weight[:, mine])
        self.sharers = 0
        for head in range(cfg.kv_heads):
            members = [s for s in range(ranks) if s * per_rank // cfg.group_size == head]
            group = dist.new_group(members)
            if head == kv_head:
                self.kv_group, self.sharers = group, len(members)

    def forward(self, x, positions, docs):
        x = self.enter(x)
        B, T, _ = x.shape
        hd = self.cfg.head_size

        def heads(t):
            return t.view(B, T, -1, hd).transpose(1, 2)

        q = apply_rope(heads(self.q(x)), positions, self.cfg.rope_base)
        k = apply_rope(heads(self.k(x)), positions, self.cfg.rope_base)
        seen = (docs[:, None] == docs[None, :]) & (positions[None, :] <= positions[:, None])
        scores = (q @ k.transpose(-2, -1) / hd**0.5).masked_fill(~seen, float("-inf"))
        y = scores.softmax(dim=-1) @ heads(self.v(x))
        return self.leave(self.o(y.transpose(1, 2).reshape(B, T, -1)))

    def sync_grads(self):
        for weight in (self.k.weight, self.v.weight):
            comm.all_reduce(weight.grad, group=self.kv_group)
            weight.grad /= self.sharers
