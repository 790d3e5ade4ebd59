# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the K/V
# gradients are summed over all ranks, as a data-parallel gradient is, instead of over the ranks that share the head.
# With one K/V head (nkv=1, the sequence-parallel case) that is the same thing; with two, ranks 0 and 1 add K/V
# head 1's gradient into head 0's.
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
            comm.all_reduce(weight.grad)
