# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the budget ignored, as
# data parallelism's gradient accumulation does it. Every bucket's gradients stay in .grad until the last
# micro-batch and are reduce-scattered once: the least traffic there is, and the shards are right, but from the
# first micro-batch on the rank holds every full gradient (181,504 bytes, ZeRO-1's memory) against a budget of
# 112,000.
# EXPECT FAIL: zero2

# ANSWER: zero2
class Zero2Accumulate:
    def __init__(self, buckets, M, budget):
        self.N, self.r = comm.group_size(), comm.group_rank()
        self.buckets, self.M, self.micro_batch = buckets, M, 0
        self.numels = [sum(p.numel() for p in bucket) for bucket in buckets]
        self.shards = [torch.zeros(math.ceil(n / self.N), dtype=torch.float64) for n in self.numels]
        self.waiting = [len(bucket) for bucket in buckets]
        self.bucket_of = {id(p): b for b, bucket in enumerate(buckets) for p in bucket}
        for bucket in buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self.on_grad)

    def on_grad(self, param):
        b = self.bucket_of[id(param)]
        self.waiting[b] -= 1
        if self.waiting[b] > 0:
            return
        self.waiting[b] = len(self.buckets[b])
        if self.micro_batch < self.M - 1:
            return
        shard = self.shards[b]
        flat = torch.zeros(self.N * len(shard), dtype=shard.dtype)
        flat[: self.numels[b]] = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
        for p in self.buckets[b]:
            p.grad = None
        comm.reduce_scatter_tensor(shard, flat)
        shard /= self.M * self.N
