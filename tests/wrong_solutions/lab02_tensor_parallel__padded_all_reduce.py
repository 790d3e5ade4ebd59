# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: instead of an
# all-gather, each rank writes its two numbers per row into its own slot of a zero [P, 2, N] tensor and all-reduces
# it: one call, the same [P, 2, N] result on every rank, and exact. But each rank hands over P times 2 numbers per
# row (the zeros travel too): 4 times the allowed contribution on 4 ranks, and on a ring twice the bytes.
# EXPECT FAIL: vocab_ce

# ANSWER: vocab_ce
class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start):
        N, Vp = logits.shape
        ranks, r = comm.group_size(), dist.get_rank()
        local = targets - vocab_start
        mine = (local >= 0) & (local < Vp)
        local = torch.where(mine, local, 0)
        target_logit = torch.where(mine, logits.gather(1, local[:, None])[:, 0], 0.0)
        stats = torch.zeros(ranks, 2, N, dtype=logits.dtype, device=logits.device)
        stats[r] = torch.stack([torch.logsumexp(logits, dim=1), target_logit])
        comm.all_reduce(stats)
        lse = torch.logsumexp(stats[:, 0], dim=0)
        ctx.save_for_backward(logits, lse, local, mine)
        return (lse - stats[:, 1].sum(dim=0)).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local, mine = ctx.saved_tensors
        grad = torch.exp(logits - lse[:, None])
        rows = torch.arange(len(local), device=logits.device)
        grad[rows[mine], local[mine]] -= 1.0
        return grad * grad_loss / len(local), None, None
