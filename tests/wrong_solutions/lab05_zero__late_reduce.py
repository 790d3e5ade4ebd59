# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: ZeRO-1's gradients in
# ZeRO-2's clothes. The hook waits for the whole backward (every parameter's gradient) before it reduce-scatters the
# buckets, so each rank holds every full gradient at once: the shards are right, the reduce-scatters happen in
# backward with the right payloads, no .grad is left, but the peak gradient memory is the shards plus all Psi
# gradients, not plus one bucket (and the buckets go in list order, not in the order backward completes them).
# EXPECT FAIL: zero2

# ANSWER: zero2
class Zero2Grads:
    def __init__(self, buckets: list[list[torch.nn.Parameter]]):
        self.N, self.r = comm.group_size(), comm.group_rank()
        self.buckets = buckets
        self.shards = [torch.zeros(math.ceil(sum(p.numel() for p in b) / self.N), dtype=b[0].dtype) for b in buckets]
        self.waiting = sum(len(b) for b in buckets)
        for bucket in buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self.on_grad)

    def on_grad(self, param: torch.Tensor) -> None:
        self.waiting -= 1
        if self.waiting > 0:
            return
        for bucket, shard in zip(self.buckets, self.shards):
            flat = torch.zeros(self.N * len(shard), dtype=shard.dtype)
            grads = torch.cat([p.grad.reshape(-1) for p in bucket])
            flat[: len(grads)] = grads
            comm.reduce_scatter_tensor(shard, flat)
            shard /= self.N
            for p in bucket:
                p.grad = None
        self.waiting = sum(len(b) for b in self.buckets)
