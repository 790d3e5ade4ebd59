# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the hooks note the order of arrival in every backward pass of the first step, not once. With
# one backward per step (part 3) that is the same thing and every check passes; with 3 micro-batches (part 4) the
# order lists every parameter three times, and the rebuilt buckets hold each gradient three times over.
# EXPECT FAIL: training

# ANSWER: overlap
class OverlappedDP:
    def __init__(self, model: torch.nn.Module, cap_bytes: int):
        self.model, self.cap, self.P = model, cap_bytes, dist.get_world_size()
        self.sync = True
        self.params = dict(model.named_parameters())
        self.name_of = {id(p): name for name, p in self.params.items()}
        self.order, self.rebuilt = [], False
        self._use(first_plan(model, cap_bytes))
        for p in self.params.values():
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _use(self, plan):
        self.buckets = [[self.params[name] for name in names] for names in plan]
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.arrived, self.next, self.started = [0] * len(plan), 0, []

    def _gradient_ready(self, param):
        if not self.rebuilt:
            self.order.append(self.name_of[id(param)])  # in every backward of the first step
        if not self.sync:
            return
        self.arrived[self.bucket_of[id(param)]] += 1
        while self.next < len(self.buckets) and self.arrived[self.next] == len(self.buckets[self.next]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[self.next]])
            self.started.append((flat, comm.all_reduce(flat, async_op=True)))
            self.next += 1

    def finish(self):
        for (flat, work), bucket in zip(self.started, self.buckets, strict=True):
            work.wait()
            flat /= self.P
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if not self.rebuilt:
            self.rebuilt = True
            self._use(plan_in_order(self.model, self.order, self.cap))
        else:
            self._use([[self.name_of[id(p)] for p in bucket] for bucket in self.buckets])
