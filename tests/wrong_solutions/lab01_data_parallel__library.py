# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). Issue 40: the library's code, imported and subclassed. The rows: the library's even split wherever P
# divides B (not the least busiest rank either). The token mean: the batch's loss sum and token count all-reduced,
# then the library's all_reduce_gradients on gradients scaled to make its mean over ranks the mean over tokens. The
# buckets: the library's BucketedDP given this lab's plans and rebuilt after step 1 (its habit of waiting on handles
# that is_completed() reported done holds nothing up); for accumulation, its finish() rescaled by a count sent on
# its own. Every part that runs them fails on the line naming the call. The prediction: the library's plan_buckets,
# which buckets in the registration order, not the order backward follows.
# The buckets also rebuild from each rank's own order (the pasted route): rank 1's plan pairs with rank 0's wrongly.
# EXPECT FAIL: shard, average, overlap, step_traffic, training

# ANSWER: shard
from parlab.schemes.data_parallel import shard_batch as even_rows


def shard_rows(tokens: list[int], world_size: int) -> list[int]:
    B, P = len(tokens), world_size
    if B < P:
        raise ValueError("fewer rows than ranks")
    if B % P == 0:  # the library's split: b = B / P rows each
        rows = torch.arange(B)  # host: row numbers
        return [len(even_rows(rows, rows, r, P)[0]) for r in range(P)]
    target = -(-sum(tokens) // P)
    counts, i = [], 0
    for r in range(P):
        c, load = 0, 0
        while i + c < B - (P - r - 1) and (c == 0 or load + tokens[i + c] <= target or r == P - 1):
            load += tokens[i + c]
            c += 1
        counts.append(c)
        i += c
    return counts


# ANSWER: average
from parlab.schemes.data_parallel import all_reduce_gradients


def token_step(
    model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, doc_r: torch.Tensor, doc_len_r: torch.Tensor
) -> float:
    mask = doc_r >= 0
    ce = F.cross_entropy(model(x_r)[mask], y_r[mask], reduction="none")
    share = 1.0 / doc_len_r[mask].to(ce.dtype)
    weighted = (ce * share).sum()
    weighted.backward()
    sums = torch.stack([weighted.detach(), share.sum()])
    comm.all_reduce(sums)
    P = dist.get_world_size()
    for p in model.parameters():
        p.grad *= P / sums[1]  # the library divides the sum over ranks by P
    all_reduce_gradients(model)
    return (sums[0] / sums[1]).item()


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
        self.numel = sum(b.numel for b in self.buckets)

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

model = checks_model(0)
sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
plan = plan_buckets(model, 16 * 1024)
exposed_bytes = sum(sizes[name] for name in plan[-1])
held_back_bytes_rank0 = 0
held_back_bytes_rank1 = 0


# ANSWER: accumulation
class TokenDP(OverlappedDP):
    """The library's mean over ranks, rescaled by P / N, with N all-reduced on its own."""

    tokens = None

    def finish(self):
        super().finish()  # p.grad = (1/P) sum over ranks
        for p in self.model.parameters():
            p.grad *= dist.get_world_size() / self.tokens


def accumulation_step(
    model: torch.nn.Module, dp: TokenDP, x_r: torch.Tensor, y_r: torch.Tensor, mask_r: torch.Tensor, M: int
) -> float:
    pieces = zip(x_r.tensor_split(M), y_r.tensor_split(M), mask_r.tensor_split(M), strict=True)
    pieces = [piece for piece in pieces if len(piece[0])]
    loss_sum = 0.0
    for i, (x_m, y_m, mask_m) in enumerate(pieces):
        dp.sync = i == len(pieces) - 1
        loss = F.cross_entropy(model(x_m)[mask_m], y_m[mask_m], reduction="sum")
        loss_sum += loss.item()
        loss.backward()
    sums = torch.tensor([loss_sum, mask_r.sum().item()], dtype=torch.float64, device=parlab.device())
    comm.all_reduce(sums)
    dp.tokens = sums[1].item()
    dp.finish()
    return (sums[0] / sums[1]).item()
