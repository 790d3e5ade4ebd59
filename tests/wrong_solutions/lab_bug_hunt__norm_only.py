# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's).
# The bug: part 2 half fixed the other way. f now runs after the replicated RMSNorm (its backward sums the
# whole dL/dn, the gains' gradients are whole on every rank), but the K/V gradients are still summed over ranks
# {0, 2} and {1, 3}, which hold different K/V heads: each K/V head's rows take another head's gradient.
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
    return [list(range(j, P, nkv)) for j in range(nkv)]


def tp_block(x, w, positions):
    B, T, H = x.shape
    hd = w["k"].shape[0]

    def heads(t):
        return t.view(B, T, -1, hd).transpose(1, 2)

    a = Copy.apply(rms_norm(x, w["attn_norm"]))
    q = apply_rope(heads(a @ w["q"].T), positions)
    k = apply_rope(heads(a @ w["k"].T), positions)
    y = gqa_attention(q, k, heads(a @ w["v"].T))
    x = x + Reduce.apply(y.transpose(1, 2).reshape(B, T, -1) @ w["o"].T)
    n = Copy.apply(rms_norm(x, w["mlp_norm"]))
    h = F.silu(n @ w["gate"].T) * (n @ w["up"].T)
    return x + Reduce.apply(h @ w["down"].T)


def sync_grads(w, group):
    for name in ("k", "v"):
        comm.all_reduce(w[name].grad, group=group)
