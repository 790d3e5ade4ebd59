# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: the loss's backward returns only dL/dlogits, forgetting that autograd wants one gradient (or
# None) per input of forward: the targets and vocab_start get none. The forward is right; in the backward, autograd
# rejects the answer on the ranks, so the check fails with the failing rank's error.
# EXPECT FAIL: vocab_ce

# ANSWER: vocab_ce
class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start):
        N, Vp = logits.shape
        ranks = comm.group_size()
        local = targets - vocab_start
        mine = (local >= 0) & (local < Vp)
        local = torch.where(mine, local, 0)
        target_logit = torch.where(mine, logits.gather(1, local[:, None])[:, 0], 0.0)
        stats = torch.stack([torch.logsumexp(logits, dim=1), target_logit])
        gathered = torch.empty(ranks * 2, N, dtype=logits.dtype)
        comm.all_gather_into_tensor(gathered, stats)
        gathered = gathered.view(ranks, 2, N)
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        ctx.save_for_backward(logits, lse, local, mine)
        return (lse - gathered[:, 1].sum(dim=0)).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local, mine = ctx.saved_tensors
        grad = torch.exp(logits - lse[:, None])
        rows = torch.arange(len(local))
        grad[rows[mine], local[mine]] -= 1.0
        return grad * grad_loss / len(local)
