# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the batch's token count and loss sum travel in an all-reduce of their own,
# started before the micro-batches, and the buckets carry the gradients alone. The numbers are right, and it costs
# only 16 bytes, but it is one more collective per step (and one the backward cannot hide): the step's
# all-reduces are not the plan's buckets.
# EXPECT FAIL: training

# ANSWER: accumulation
class TokenDP(OverlappedDP):
    """OverlappedDP that divides by the batch's real tokens, which accumulation_step all-reduces itself."""

    tokens = None

    def finish(self) -> None:
        self._write_back([self._wait(k) for k in range(len(self.started))], self.tokens)
        self._next_step()


def accumulation_step(
    model: torch.nn.Module, dp: TokenDP, x_r: torch.Tensor, y_r: torch.Tensor, mask_r: torch.Tensor, M: int
) -> float:
    pieces = zip(x_r.tensor_split(M), y_r.tensor_split(M), mask_r.tensor_split(M), strict=True)
    pieces = [piece for piece in pieces if len(piece[0])]
    losses = []
    for i, (x_m, y_m, mask_m) in enumerate(pieces):
        dp.sync = i == len(pieces) - 1
        loss = F.cross_entropy(model(x_m)[mask_m], y_m[mask_m], reduction="sum")
        losses.append(loss.item())
        loss.backward()
    sums = torch.tensor([sum(losses), mask_r.sum().item()], dtype=torch.float64, device=parlab.device())
    comm.all_reduce(sums)  # the batch's loss sum and real tokens: a collective of its own
    dp.tokens = sums[1].item()
    dp.finish()
    return (sums[0] / sums[1]).item()
