# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The pasted route: parlab's BucketedDP copied in (no import), pointed at first_plan, and rebuilt after
# step 1 with plan_in_order from the order this rank's backward produced. Two things go wrong. Its hook closes the
# timeline bar of every finished all-reduce with wait() (on handles is_completed() reported done: it holds nothing
# up, but the lab forbids any wait in a hook). And each rank rebuilds from its own order: rank 1 produces gate's
# gradient before up's, so its buckets have rank 0's sizes but not its contents; the all-reduces add rank 0's up to
# rank 1's gate, no error is raised, and the parameters leave one device's. Part 4's TokenDP, written on the
# solution's OverlappedDP, finds none of its methods here.
# EXPECT FAIL: overlap, training

# ANSWER: overlap
class OverlappedDP:
    """A copy of BucketedDP with a rebuild."""

    def __init__(self, model: torch.nn.Module, cap_bytes: int):
        self.model, self.cap, self.P = model, cap_bytes, dist.get_world_size()
        self.sync = True
        self.named = dict(model.named_parameters())
        self.names = {id(p): name for name, p in self.named.items()}
        self.order, self.rebuilt = [], False
        self._use(first_plan(model, cap_bytes))
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _use(self, plan):
        self.buckets = [[self.named[n] for n in names] for names in plan]
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [set() for _ in plan]
        self.flat, self.work = [None] * len(plan), [None] * len(plan)
        self.next_to_start = 0

    def _grad_ready(self, param):
        if not self.rebuilt and len(self.order) < len(self.named):
            self.order.append(self.names[id(param)])
        if not self.sync:
            return
        self.ready[self.bucket_of[id(param)]].add(id(param))
        self._start_ready_buckets()
        self._note_finished()

    def _start_ready_buckets(self):
        while self.next_to_start < len(self.buckets):
            k = self.next_to_start
            if len(self.ready[k]) < len(self.buckets[k]):
                return
            self.flat[k] = torch.cat([p.grad.reshape(-1) for p in self.buckets[k]])
            self.work[k] = comm.all_reduce(self.flat[k], async_op=True)
            self.next_to_start += 1

    def _note_finished(self):
        for work in self.work[: self.next_to_start]:
            if work is not None and work.is_completed():
                work.wait()  # returns at once

    def finish(self):
        for k, bucket in enumerate(self.buckets):
            self.work[k].wait()
            self.flat[k].div_(self.P)
            offset = 0
            for p in bucket:
                p.grad.copy_(self.flat[k][offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if not self.rebuilt:
            self.rebuilt = True
            self._use(plan_in_order(self.model, self.order, self.cap))
        else:
            self._use([[self.names[id(p)] for p in bucket] for bucket in self.buckets])
