# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's).
# The bug: part 2's drift "fixed" where it shows. The K/V groups are right now, and the gains'
# gradients, each rank's its own part (f still runs before the RMSNorm), are summed over the ranks after backward.
# Every weight now trains as on one device, but sync_grads all-reduces the gains' 2H numbers beside the K/V head's
# rows, where Megatron's block needs no such call (f after the norm sums the gains' gradient in the one backward
# all-reduce it already makes): the bytes of sync_grads catch it.
# EXPECT FAIL: tp_training

# ANSWER: megatron_block
class Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad


class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        y = partial.clone()
        comm.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


def kv_groups(P, nq, nkv):
    group = nq // nkv
    return [[r for r in range(P) if r * nq // P // group == j] for j in range(nkv)]


def tp_block(x, w, positions):
    B, T, H = x.shape
    hd = w["k"].shape[0]

    def heads(t):
        return t.view(B, T, -1, hd).transpose(1, 2)

    a = rms_norm(Copy.apply(x), w["attn_norm"])
    q = apply_rope(heads(a @ w["q"].T), positions)
    k = apply_rope(heads(a @ w["k"].T), positions)
    y = gqa_attention(q, k, heads(a @ w["v"].T))
    x = x + Reduce.apply(y.transpose(1, 2).reshape(B, T, -1) @ w["o"].T)
    n = rms_norm(Copy.apply(x), w["mlp_norm"])
    h = F.silu(n @ w["gate"].T) * (n @ w["up"].T)
    return x + Reduce.apply(h @ w["down"].T)


def sync_grads(w, group):
    for name in ("k", "v"):
        comm.all_reduce(w[name].grad, group=group)
    for name in ("attn_norm", "mlp_norm"):  # each rank's gain gradient is its own units' part: sum them
        comm.all_reduce(w[name].grad)
