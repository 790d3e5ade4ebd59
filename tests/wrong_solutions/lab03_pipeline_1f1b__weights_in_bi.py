# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: BI computes the
# whole backward, weight gradients included, and BW only adds the stored results. The numbers are right, but BI now
# costs what B costs and BW nothing: there is no work left to fill the bubble with. The FLOP count of BI catches it.
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
        self.saved[mb] = (grad_u.T @ x, grad_y.T @ h)
        return grad_u @ self.w1

    def backward_weight(self, mb):
        grad_w1, grad_w2 = self.saved.pop(mb)
        self.grad_w1 += grad_w1
        self.grad_w2 += grad_w2
