# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: lesson 02's
# loss as it is: three all-reduces of N numbers in forward (the max, the sum of exponentials, the target logit).
# It is exact and never gathers the logits, but the part asks for one collective of at most 2 numbers per row.
# EXPECT FAIL: vocab_ce

# ANSWER: vocab_ce
class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start):
        N, Vp = logits.shape
        m = logits.max(dim=-1).values
        comm.all_reduce(m, op=comm.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp)
        local = targets - vocab_start
        mine = (local >= 0) & (local < Vp)
        local = torch.where(mine, local, 0)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        comm.all_reduce(target_logit)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0])
        grad[rows, local] -= mine.to(grad.dtype)
        return grad * (grad_loss / grad.shape[0]), None, None
