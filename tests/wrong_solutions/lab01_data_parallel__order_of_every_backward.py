# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the hooks note the order of arrival in every backward pass of the first
# step, not once. With one backward per step (part 3) that is the same thing and every check passes; with 3
# micro-batches (part 4) the order lists every parameter two or three times, and the rebuilt buckets hold each
# gradient as often.
# EXPECT FAIL: training

# ANSWER: overlap
class OverlappedDP:
    """Gradient averaging in buckets whose all-reduces start during backward, rebuilt after the first step."""

    def __init__(self, model: torch.nn.Module, cap_bytes: int):
        self.model, self.cap, self.P = model, cap_bytes, dist.get_world_size()
        self.sync = True  # for accumulation: while False, backward only accumulates .grad (no communication)
        self.params = dict(model.named_parameters())
        self.name_of = {id(p): name for name, p in self.params.items()}
        self.order, self.rebuilt = [], False  # the first backward's order of arrival; rebuilt after step 1
        self._use(first_plan(model, cap_bytes))
        for p in self.params.values():
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _use(self, plan: list[list[str]]) -> None:
        """Start a step with these buckets: nothing arrived, nothing started."""
        self.buckets = [[self.params[name] for name in names] for names in plan]  # [bucket][parameter]
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.arrived = [0] * len(plan)  # gradients arrived this step, per bucket
        self.next = 0  # the next bucket to start, in plan order
        self.started = []  # (flat gradients of bucket k, its all-reduce handle), bucket 0 first

    def _flatten(self, k: int) -> torch.Tensor:
        """Bucket k's gradients side by side: [numel of the bucket]."""
        return torch.cat([p.grad.reshape(-1) for p in self.buckets[k]])

    def _gradient_ready(self, param: torch.Tensor) -> None:
        """Runs mid-backward, right after param.grad has been accumulated."""
        if not self.rebuilt:
            self.order.append(self.name_of[id(param)])  # in every backward of the first step
        if not self.sync:
            return
        self.arrived[self.bucket_of[id(param)]] += 1
        while self.next < len(self.buckets) and self.arrived[self.next] == len(self.buckets[self.next]):
            flat = self._flatten(self.next)
            self.started.append((flat, comm.all_reduce(flat, async_op=True)))  # runs while backward goes on
            self.next += 1

    def finish(self) -> None:
        """After backward, before the optimizer step: p.grad = (1/P) sum over ranks of p.grad, every p."""
        self._write_back([self._wait(k) for k in range(len(self.started))], self.P)
        self._next_step()

    def _wait(self, k: int) -> torch.Tensor:
        """Bucket k's sum over ranks, once its all-reduce is done."""
        flat, work = self.started[k]
        work.wait()
        return flat

    def _write_back(self, sums: list[torch.Tensor], divisor: float) -> None:
        """p.grad = its slice of its bucket's sum / divisor, for every p."""
        for flat, bucket in zip(sums, self.buckets, strict=True):
            flat /= divisor
            offset = 0
            for p in bucket:  # slice [offset, offset + numel) of the bucket is p's gradient
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def _rank0_order(self) -> list[str]:
        """Rank 0's order of arrival, on every rank: one broadcast of the parameters' indices (room for 2 per
        parameter, -1 for none)."""
        names = list(self.params)
        index = torch.full((2 * len(names),), -1, device=parlab.device())
        order = [names.index(name) for name in self.order][: len(index)]
        index[: len(order)] = torch.tensor(order, device=parlab.device())
        comm.broadcast(index, src=0)
        return [names[i] for i in index.tolist() if i >= 0]

    def _next_step(self) -> None:
        if not self.rebuilt:  # once: DDP's rebuild, from what the first backward did
            self.rebuilt = True
            self._use(plan_in_order(self.model, self._rank0_order(), self.cap))
        else:
            self._use([[self.name_of[id(p)] for p in bucket] for bucket in self.buckets])
