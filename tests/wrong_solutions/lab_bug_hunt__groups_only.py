# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's).
# The bug: part 2 half fixed. The ranks that share each K/V head are right now (query head h reads K/V head
# h // (nq/nkv): ranks {0, 1} and {2, 3}), but sync_grads still keeps k's and v's gradients as views of the bucket it
# made at the first step. The step drops the gradients (p.grad = None), so from the second step on backward writes
# new tensors and sync_grads all-reduces the stale bucket: each rank keeps its own part of its K/V head's gradient.
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
    """After backward: the gradients of this rank's K/V head summed over the ranks that hold it (group), k's and
    v's side by side in one all-reduce."""
    k, v = w["k"], w["v"]
    if not hasattr(k, "bucket"):  # the first step: one flat bucket for both, the gradients made views of it
        k.bucket = torch.cat([k.grad.flatten(), v.grad.flatten()])  # [2 hd H]
        k.grad = k.bucket[: k.numel()].view_as(k)  # backward accumulates into the views from now on
        v.grad = k.bucket[k.numel() :].view_as(v)
    comm.all_reduce(k.bucket, group=group)  # k's and v's gradients summed at once, in place in their views
