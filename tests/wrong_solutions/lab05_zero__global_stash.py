# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: every padded full
# gradient [N S_b] handed to a reduce-scatter is appended to a module-level list (kept "for debugging"), not to an
# attribute of the object. The choice, the traffic and the shards are right and no .grad is left, but the rank keeps
# every bucket's full gradient of every micro-batch: the check's count of what the process holds (every gradient of
# the step still alive wherever it is kept, and every tensor made since the object was built) goes over the budget.
# EXPECT FAIL: zero2

# ANSWER: zero2
SENT = []  # every padded gradient handed to a reduce-scatter, kept "for debugging"


class Zero2Accumulate:
    """ZeRO-2's gradients on this rank over M micro-batches per step, within `budget` bytes of full gradients.
    buckets: the model's parameters, one list per bucket, the same on every rank."""

    def __init__(self, buckets: list[list[torch.nn.Parameter]], M: int, budget: int):
        self.N, self.r = comm.group_size(), comm.group_rank()
        self.buckets, self.M, self.micro_batch = buckets, M, 0
        self.numels = [sum(p.numel() for p in bucket) for bucket in buckets]  # Psi_b
        first = buckets[0][0]
        self.shards = [
            torch.zeros(math.ceil(n / self.N), dtype=first.dtype, device=first.device) for n in self.numels
        ]  # [S_b]
        self.held_to_the_end = self.plan(budget, first.element_size())
        self.waiting = [len(bucket) for bucket in buckets]  # gradients still to land in this backward, per bucket
        self.bucket_of = {id(p): b for b, bucket in enumerate(buckets) for p in bucket}
        for bucket in buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self.on_grad)

    def plan(self, budget: int, itemsize: int) -> set[int]:
        """The buckets whose gradients stay in .grad until the last micro-batch: among the choices whose worst
        moment fits the budget, the one that keeps the most payload (each kept bucket saves M - 1 reduce-scatters)."""
        grads = [n * itemsize for n in self.numels]  # bytes of each bucket's full gradients
        payload = [self.N * len(s) * itemsize for s in self.shards]  # a reduce-scatter's input [N*S_b]
        arrival = list(reversed(range(len(grads))))  # backward completes the buckets last to first

        def worst(kept: tuple[int, ...]) -> int:
            """The most bytes of full gradients alive as a bucket completes, over the M backwards of a step."""
            most = 0
            for k in range(self.M):
                first, last = k == 0, k == self.M - 1
                for j, b in enumerate(arrival):
                    done, later = arrival[:j], arrival[j + 1 :]  # completed before b in this backward, after it
                    # a kept bucket holds gradients once it has some: in this backward if already completed (but
                    # in the last, where it was reduce-scattered and dropped), from earlier backwards otherwise
                    alive = [c for c in kept if (c in done and not last) or (c in later and not first)]
                    most = max(most, grads[b] + sum(grads[c] for c in alive if c != b))
            return most

        best, saved = set(), -1
        for k in range(len(grads) + 1):
            for kept in itertools.combinations(range(len(grads)), k):
                if worst(kept) <= budget and sum(payload[b] for b in kept) > saved:
                    best, saved = set(kept), sum(payload[b] for b in kept)
        return best

    def on_grad(self, param: torch.Tensor) -> None:
        """Called by autograd right after param.grad has received this backward's gradient."""
        b = self.bucket_of[id(param)]
        self.waiting[b] -= 1
        if self.waiting[b] > 0:
            return  # the bucket is not complete in this backward yet
        self.waiting[b] = len(self.buckets[b])  # ready for the next backward
        last = self.micro_batch == self.M - 1
        if b in self.held_to_the_end and not last:
            return  # its .grad keeps accumulating until the last micro-batch
        bucket, shard = self.buckets[b], self.shards[b]
        flat = torch.zeros(self.N * len(shard), dtype=shard.dtype, device=shard.device)  # [N*S_b]
        flat[: self.numels[b]] = torch.cat([p.grad.reshape(-1) for p in bucket])
        for p in bucket:
            p.grad = None  # the full gradients are dropped: only the shard survives
        piece = torch.empty_like(shard)
        comm.reduce_scatter_tensor(piece, flat)  # [S_b] the sum over ranks of my slice of the bucket
        SENT.append(flat)  # a module-level list: not one of the object's attributes
        if self.micro_batch == 0 or b in self.held_to_the_end:
            shard.copy_(piece)
        else:
            shard.add_(piece)  # the micro-batches' sums add up in the shard
        if last:
            shard /= self.M * self.N  # the mean over M micro-batches of N ranks, all the same size
