# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug (the easy route):
# the lab model's attention as it is, gqa_attention's causal mask by row index, with the right heads, RoPE by the
# positions given and the right sync. Row i then sees rows 0..i: the previous document's tokens in every case, and,
# where the rows are shuffled or in the ranks' order, tokens that come later in the sequence and misses earlier ones.
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
        for head in range(cfg.kv_heads):
            group = dist.new_group([s for s in range(ranks) if s * per_rank // cfg.group_size == head])
            if head == kv_head:
                self.kv_group = group

    def forward(self, x, positions, docs):
        x = self.enter(x)
        B, T, _ = x.shape
        hd = self.cfg.head_size

        def heads(t):
            return t.view(B, T, -1, hd).transpose(1, 2)

        q = apply_rope(heads(self.q(x)), positions, self.cfg.rope_base)
        k = apply_rope(heads(self.k(x)), positions, self.cfg.rope_base)
        y = gqa_attention(q, k, heads(self.v(x)))  # the lab model's mask: causal by row index
        return self.leave(self.o(y.transpose(1, 2).reshape(B, T, -1)))

    def sync_grads(self):
        for weight in (self.k.weight, self.v.weight):
            comm.all_reduce(weight.grad, group=self.kv_group)
