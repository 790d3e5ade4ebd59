# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: BI keeps what
# BW needs in one slot, as if BW always ran right after its own BI. In a zero-bubble order other micro-batches' BI
# run before a postponed BW, which then computes its weight gradient from another micro-batch's tensors.
# EXPECT FAIL: zero_bubble

# ANSWER: zero_bubble
class SplitStage:
    def __init__(self, w1, w2):
        self.w1, self.w2 = w1, w2
        self.grad_w1, self.grad_w2 = torch.zeros_like(w1), torch.zeros_like(w2)
        self.saved = {}

    def forward(self, mb, x):
        h = torch.tanh(x @ self.w1.T)
        self.saved[mb] = (x, h)
        return h @ self.w2.T

    def backward_input(self, mb, grad_y):
        x, h = self.saved[mb]
        grad_u = (grad_y @ self.w2) * (1 - h * h)
        self.pending = (x, h, grad_y, grad_u)
        return grad_u @ self.w1

    def backward_weight(self, mb):
        x, h, grad_y, grad_u = self.pending
        self.grad_w2 += grad_y.T @ h
        self.grad_w1 += grad_u.T @ x
