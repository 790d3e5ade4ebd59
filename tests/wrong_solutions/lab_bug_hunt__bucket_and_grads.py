# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's).
# The bug: part 2's drift "fixed" where it shows. The K/V groups are right now, and where the gradients backward
# wrote are no longer the bucket's views (every step after the first), sync_grads all-reduces them too. Every weight
# now trains as on one device, but from the second step on sync_grads moves the K/V head's rows twice (the stale
# bucket, then the gradients): the bytes of sync_grads catch it.
# EXPECT FAIL: tp_training

# ANSWER: megatron_block
class Copy(torch.autograd.Function):
    """Megatron's f: identity forward; backward, the sum over ranks of the incoming gradient. [B, T, H]."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad


class Reduce(torch.autograd.Function):
    """Megatron's g: forward, the sum over ranks of their partial outputs; identity backward. [B, T, H]."""

    @staticmethod
    def forward(ctx, partial):
        y = partial.clone()
        comm.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


def kv_groups(P: int, nq: int, nkv: int) -> list[list[int]]:
    """The ranks that hold each K/V head, one list per K/V head."""
    group = nq // nkv
    return [[r for r in range(P) if r * nq // P // group == j] for j in range(nkv)]


def tp_block(x, w, positions):
    """The lab model's block on this rank's heads and SwiGLU units. x: [B, T, H], replicated; w: this rank's
    weights by name (attn_norm, mlp_norm: [H]; q: [nq/P hd, H]; k, v: [hd, H]; o: [H, nq/P hd]; gate, up:
    [F/P, H]; down: [H, F/P]); positions: [T]. Returns [B, T, H], the same on every rank."""
    B, T, H = x.shape
    hd = w["k"].shape[0]

    def heads(t):  # [B, T, n hd] -> [B, n, T, hd]
        return t.view(B, T, -1, hd).transpose(1, 2)

    a = Copy.apply(rms_norm(x, w["attn_norm"]))  # the replicated norm on every rank alike, then f
    q = apply_rope(heads(a @ w["q"].T), positions)  # [B, nq/P, T, hd]: this rank's query heads
    k = apply_rope(heads(a @ w["k"].T), positions)  # [B, 1, T, hd]: the K/V head they read
    y = gqa_attention(q, k, heads(a @ w["v"].T))  # [B, nq/P, T, hd]
    x = x + Reduce.apply(y.transpose(1, 2).reshape(B, T, -1) @ w["o"].T)  # g: [B, T, H]
    n = Copy.apply(rms_norm(x, w["mlp_norm"]))
    h = F.silu(n @ w["gate"].T) * (n @ w["up"].T)  # [B, T, F/P]: this rank's SwiGLU units
    return x + Reduce.apply(h @ w["down"].T)  # [B, T, H]


def sync_grads(w, group):
    k, v = w["k"], w["v"]
    if not hasattr(k, "bucket"):
        k.bucket = torch.cat([k.grad.flatten(), v.grad.flatten()])
        k.grad = k.bucket[: k.numel()].view_as(k)
        v.grad = k.bucket[k.numel() :].view_as(v)
    comm.all_reduce(k.bucket, group=group)
    for name in ("k", "v"):  # patched where it shows: the gradients backward wrote, summed too
        if w[name].grad.data_ptr() != k.bucket.data_ptr() + (0 if name == "k" else k.numel() * 8):
            comm.all_reduce(w[name].grad, group=group)
