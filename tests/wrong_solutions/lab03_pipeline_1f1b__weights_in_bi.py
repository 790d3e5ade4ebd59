# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: BI computes the
# whole backward, weight gradients included, and BW only adds the stored results. The numbers are right, but BI now
# costs what B costs and BW nothing: there is no work left to fill the bubble with. The FLOP count of BI catches it,
# and so do the bytes held (three weight-sized gradients per micro-batch between its BI and its BW).
# EXPECT FAIL: zero_bubble

# ANSWER: zero_bubble
class SplitMLP:
    def __init__(self, w_gate, w_up, w_down):
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.grad_gate, self.grad_up, self.grad_down = (torch.zeros_like(w) for w in (w_gate, w_up, w_down))
        self.saved = {}

    def forward(self, mb, x):
        a, u = x @ self.w_gate.T, x @ self.w_up.T
        self.saved[mb] = (x, a, u)
        return (F.silu(a) * u) @ self.w_down.T

    def backward_input(self, mb, grad_y):
        x, a, u = (t.flatten(0, 1) for t in self.saved.pop(mb))
        g = grad_y.flatten(0, 1)
        sig = torch.sigmoid(a)
        grad_h = g @ self.w_down
        grad_u = grad_h * a * sig
        grad_a = grad_h * u * sig * (1 + a * (1 - sig))
        self.saved[mb] = (grad_a.T @ x, grad_u.T @ x, g.T @ (a * sig * u))
        return (grad_a @ self.w_gate + grad_u @ self.w_up).view_as(grad_y)

    def backward_weight(self, mb):
        grad_gate, grad_up, grad_down = self.saved.pop(mb)
        self.grad_gate += grad_gate
        self.grad_up += grad_up
        self.grad_down += grad_down
