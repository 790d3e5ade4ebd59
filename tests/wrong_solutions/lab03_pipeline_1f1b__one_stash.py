# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: BI keeps what BW
# needs in one slot, as if BW always ran right after its own BI. In a zero-bubble order other micro-batches' BI run
# before a postponed BW, which then computes its weight gradients from another micro-batch's tensors (dL/dx and
# the FLOPs are right; the one slot also outlives the last BW, which the bytes held see).
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
        x, a, u = self.saved.pop(mb)
        sig = torch.sigmoid(a)
        grad_h = grad_y @ self.w_down
        grad_u = grad_h * a * sig
        grad_a = grad_h * u * sig * (1 + a * (1 - sig))
        self.pending = (x, grad_y, grad_h)
        return grad_a @ self.w_gate + grad_u @ self.w_up

    def backward_weight(self, mb):
        x, grad_y, grad_h = (t.flatten(0, 1) for t in self.pending)
        a, u = x @ self.w_gate.T, x @ self.w_up.T
        sig = torch.sigmoid(a)
        s = a * sig
        self.grad_down += grad_y.T @ (s * u)
        self.grad_gate += (grad_h * u * sig * (1 + a * (1 - sig))).T @ x
        self.grad_up += (grad_h * s).T @ x
