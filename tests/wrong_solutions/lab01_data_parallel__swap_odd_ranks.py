# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug (a student's find): no agreement at all. Each rank rebuilds from its own order of arrival and,
# "knowing" that odd ranks compute up before gate, swaps gate and up back on odd ranks: right when exactly the odd
# ranks have that build (the case a student sees first, and part 4's, where rank 0 alone has it: rank 1's swap gives
# rank 0's order). In the check's second case rank 0 has it too: rank 1 swaps its order away from rank 0's, the
# buckets keep their sizes, and the all-reduces sum rank 0's up with rank 1's gate, silently.
# EXPECT FAIL: overlap

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
        self.buckets = [[self.params[name] for name in names] for names in plan]
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.arrived = [0] * len(plan)
        self.next = 0
        self.started = []

    def _flatten(self, k: int) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) for p in self.buckets[k]])

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if not self.rebuilt and len(self.order) < len(self.params):
            self.order.append(self.name_of[id(param)])
        if not self.sync:
            return
        self.arrived[self.bucket_of[id(param)]] += 1
        while self.next < len(self.buckets) and self.arrived[self.next] == len(self.buckets[self.next]):
            flat = self._flatten(self.next)
            self.started.append((flat, comm.all_reduce(flat, async_op=True)))
            self.next += 1

    def finish(self) -> None:
        self._write_back([self._wait(k) for k in range(len(self.started))], self.P)
        self._next_step()

    def _rank0_order(self) -> list[str]:
        """Rank 0's order, guessed without asking: odd ranks swap each block's gate and up back."""
        order = list(self.order)
        if dist.get_rank() % 2:
            for i, name in enumerate(self.order):
                if ".mlp.gate." in name:
                    j = order.index(name.replace(".mlp.gate.", ".mlp.up."))
                    order[i], order[j] = order[j], order[i]
        return order

    def _wait(self, k: int) -> torch.Tensor:
        flat, work = self.started[k]
        work.wait()
        return flat

    def _write_back(self, sums: list[torch.Tensor], divisor: float) -> None:
        for flat, bucket in zip(sums, self.buckets, strict=True):
            flat /= divisor
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def _next_step(self) -> None:
        if not self.rebuilt:
            self.rebuilt = True
            self._use(plan_in_order(self.model, self._rank0_order(), self.cap))
        else:
            self._use([[self.name_of[id(p)] for p in bucket] for bucket in self.buckets])
