# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug (a student's first try): every micro-batch tensor_split gives is run, the empty one included
# (rank 1 holds 2 rows: tensor_split(3) gives 1, 1 and 0). The lab model cannot run a micro-batch of 0 rows: rank 1's
# forward raises, and the check says so in a FAIL line naming the rank and its error.
# EXPECT FAIL: training

# ANSWER: accumulation
class TokenDP(OverlappedDP):
    """Your OverlappedDP, made to average by real tokens: after finish(), every p.grad is the gradient of the mean
    loss over the real tokens of the whole global batch. No collective but the buckets' all-reduces."""

    extra = None  # [2]: this rank's loss sum and real tokens for the step, set before the backward that communicates

    def _flatten(self, k: int) -> torch.Tensor:
        flat = super()._flatten(k)
        return torch.cat([flat, self.extra]) if k == 0 else flat  # bucket 0 carries the two numbers

    def finish(self) -> None:
        sums = [self._wait(k) for k in range(len(self.started))]
        loss_sum, tokens = sums[0][-2:].tolist()  # over every rank: the batch's loss sum and its N real tokens
        sums[0] = sums[0][:-2]
        self.loss = loss_sum / tokens
        self._write_back(sums, tokens)  # the gradient of the loss sum / N
        self._next_step()


def accumulation_step(
    model: torch.nn.Module, dp: TokenDP, x_r: torch.Tensor, y_r: torch.Tensor, mask_r: torch.Tensor, M: int
) -> float:
    """This rank's part of one optimizer step, in M micro-batches; returns the mean loss over the real tokens of the
    whole global batch. x_r, y_r, mask_r: [b, T], this rank's rows. On return dp.finish() has run."""
    pieces = zip(x_r.tensor_split(M), y_r.tensor_split(M), mask_r.tensor_split(M), strict=True)
    loss_sum = 0.0
    for i, (x_m, y_m, mask_m) in enumerate(pieces):  # [b_m, T] each
        dp.sync = i == M - 1  # the hooks start the buckets in the last backward only
        loss = F.cross_entropy(model(x_m)[mask_m], y_m[mask_m], reduction="sum")  # 0 for a micro-batch of padding
        loss_sum += loss.item()
        if dp.sync:  # known before the backward that starts the buckets
            dp.extra = torch.tensor([loss_sum, mask_r.sum().item()], dtype=loss.dtype, device=parlab.device())
        loss.backward()  # .grad accumulates the gradient of this rank's loss sum
    dp.finish()
    return dp.loss
