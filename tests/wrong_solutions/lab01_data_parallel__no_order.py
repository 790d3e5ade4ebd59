# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug (issue 40): no plan-order guard. Each bucket's all-reduce starts the moment the bucket is
# complete, and finish() keeps each handle with its bucket, so the gradients come out right. But the first plan's
# bucket 0 waits for blocks.1.attn_norm while buckets 1 to 3 are already complete: this rank starts them first. On
# ranks whose backward ran in another order (unused parameters, another control flow) the k-th all-reduces would
# be different buckets; collectives are matched by their order.
# EXPECT FAIL: overlap, training

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
        self.arrived = [0] * len(plan)
        self.started = []  # (bucket index, flat gradients, handle), in the order they started

    def _gradient_ready(self, param):
        if not self.rebuilt and len(self.order) < len(self.params):
            self.order.append(self.name_of[id(param)])
        if not self.sync:
            return
        k = self.bucket_of[id(param)]
        self.arrived[k] += 1
        if self.arrived[k] == len(self.buckets[k]):  # complete: start it now
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[k]])
            self.started.append((k, flat, comm.all_reduce(flat, async_op=True)))

    def finish(self):
        for k, flat, work in self.started:
            work.wait()
            flat /= self.P
            offset = 0
            for p in self.buckets[k]:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if not self.rebuilt:
            self.rebuilt = True
            self._use(plan_in_order(self.model, self.order, self.cap))
        else:
            self._use([[self.name_of[id(p)] for p in bucket] for bucket in self.buckets])
