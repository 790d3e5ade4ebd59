# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the buckets are never rebuilt. Everything is right in step 1, and the gradients stay right,
# but from step 2 on the all-reduces are still the first plan's buckets, which wait for each other: bucket 0 for
# blocks.1.attn_norm, the last gradient of block 1.
# EXPECT FAIL: overlap, training

# ANSWER: overlap
class OverlappedDP:
    def __init__(self, model: torch.nn.Module, cap_bytes: int):
        self.model, self.P = model, dist.get_world_size()
        self.sync = True
        params = dict(model.named_parameters())
        self.buckets = [[params[name] for name in names] for names in first_plan(model, cap_bytes)]
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.arrived, self.next, self.started = [0] * len(self.buckets), 0, []
        for p in params.values():
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, param):
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
        self.arrived, self.next, self.started = [0] * len(self.buckets), 0, []
