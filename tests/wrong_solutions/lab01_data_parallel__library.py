# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). Issue 40: the library's code, imported and subclassed. The rows: the library's shard_batch where the
# batch splits evenly. The average: the library's all_reduce_gradients, then a factor that turns its mean over ranks
# into the mean over rows. The buckets: the library's BucketedDP given this lab's plans. All the numbers and the
# traffic are right; the profile hook sees the calls into parlab/schemes/data_parallel.py and names them. The
# prediction: the library's plan_buckets, which buckets in the registration order, not the order backward follows.
# EXPECT FAIL: shard, average, overlap, step_traffic, training

# ANSWER: shard
from parlab.schemes.data_parallel import shard_batch as even_rows


def shard_batch(x, y, rank, world_size):
    B = x.shape[0]
    if B % world_size == 0:
        return even_rows(x, y, rank, world_size)
    if B < world_size:
        raise ValueError("fewer rows than ranks")
    base, extra = divmod(B, world_size)
    start = rank * base + min(rank, extra)
    return x[start : start + base + (rank < extra)], y[start : start + base + (rank < extra)]


# ANSWER: average
from parlab.schemes.data_parallel import all_reduce_gradients


def average_gradients(model, rows, batch_rows):
    P = dist.get_world_size()
    for p in model.parameters():
        p.grad *= P * rows / batch_rows
    all_reduce_gradients(model)


# ANSWER: overlap
from parlab.schemes.data_parallel import Bucket, BucketedDP


class OverlappedDP(BucketedDP):
    def __init__(self, model, cap_bytes):
        super().__init__(model)
        self.cap, self.order, self.rebuilt = cap_bytes, [], False
        self.names = {id(p): name for name, p in model.named_parameters()}
        self._use(first_plan(model, cap_bytes))
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._note)

    def _use(self, plan):
        named = dict(self.model.named_parameters())
        self.buckets = [Bucket(k, names, [named[n] for n in names]) for k, names in enumerate(plan)]
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}

    def _note(self, param):
        if not self.rebuilt and len(self.order) < len(self.names):
            self.order.append(self.names[id(param)])

    def finish(self):
        super().finish()
        if not self.rebuilt:
            self.rebuilt = True
            self._use(plan_in_order(self.model, self.order, self.cap))


# PREDICT: step_traffic
from parlab.schemes.data_parallel import plan_buckets

model = checks.checks_model()
sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
plan = plan_buckets(model, 40 * 1024)
allreduce_calls = len(plan)
allreduce_bytes = sum(sizes.values())
exposed_bytes = sum(sizes[name] for name in plan[-1])
