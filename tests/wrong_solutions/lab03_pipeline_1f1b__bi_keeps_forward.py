# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: BI keeps what
# the forward kept (x, a, u) beside dL/dy, and BW goes through the down projection again for dL/dh: four products,
# within BW's five. But a micro-batch then holds 2H + 2F numbers per token between its BI and its BW, one [b, T, F]
# tensor over the budget of 2H + F: the check sees the bytes held after the first BI.
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
        x, a, u = self.saved[mb]
        sig = torch.sigmoid(a)
        grad_h = grad_y @ self.w_down
        grad_u = grad_h * a * sig
        grad_a = grad_h * u * sig * (1 + a * (1 - sig))
        self.saved[mb] = (x, a, u, grad_y)
        return grad_a @ self.w_gate + grad_u @ self.w_up

    def backward_weight(self, mb):
        x, a, u, grad_y = (t.flatten(0, 1) for t in self.saved.pop(mb))
        sig = torch.sigmoid(a)
        grad_h = grad_y @ self.w_down
        grad_u = grad_h * a * sig
        grad_a = grad_h * u * sig * (1 + a * (1 - sig))
        self.grad_down += grad_y.T @ (a * sig * u)
        self.grad_gate += grad_a.T @ x
        self.grad_up += grad_u.T @ x
