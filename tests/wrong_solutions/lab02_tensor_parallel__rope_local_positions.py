# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: RoPE rotates q
# and k by 0..T-1, the rows' places in the tensor, instead of the positions it is given; the document mask is right.
# Attention scores depend only on the difference of two tokens' positions, and a token sees only its own document:
# where each document's rows are in order (the first case, a document resumed at 5 included) the differences are
# right; where the rows are shuffled or in the ranks' order they are not.
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

        local = torch.arange(T, device=x.device)  # the rows' places... counted from 0 here
        q = apply_rope(heads(self.q(x)), local, self.cfg.rope_base)
        k = apply_rope(heads(self.k(x)), local, self.cfg.rope_base)
        seen = (docs[:, None] == docs[None, :]) & (positions[None, :] <= positions[:, None])
        scores = (q @ k.transpose(-2, -1) / hd**0.5).masked_fill(~seen, float("-inf"))
        y = scores.softmax(dim=-1) @ heads(self.v(x))
        return self.leave(self.o(y.transpose(1, 2).reshape(B, T, -1)))

    def sync_grads(self):
        for weight in (self.k.weight, self.v.weight):
            comm.all_reduce(weight.grad, group=self.kv_group)
