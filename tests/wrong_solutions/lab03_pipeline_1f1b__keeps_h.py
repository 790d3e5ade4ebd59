# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: BI keeps the
# one [b, T, F] tensor the budget allows beside x and dL/dy, but the wrong one: h = silu(a) u, the down projection's
# input. It gives dL/dW_down at once, but the gate's and the up projection's output gradients need dL/dh (a product)
# and both a and u (two more), which h cannot give back: six products in BW, one over the budget of five.
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
        self.saved[mb] = (x, grad_y, a * sig * u)
        return grad_a @ self.w_gate + grad_u @ self.w_up

    def backward_weight(self, mb):
        x, grad_y, h = (t.flatten(0, 1) for t in self.saved.pop(mb))
        self.grad_down += grad_y.T @ h
        a, u, grad_h = x @ self.w_gate.T, x @ self.w_up.T, grad_y @ self.w_down
        sig = torch.sigmoid(a)
        self.grad_gate += (grad_h * u * sig * (1 + a * (1 - sig))).T @ x
        self.grad_up += (grad_h * a * sig).T @ x
