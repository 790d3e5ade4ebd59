# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the lesson's
# executor's way transcribed: the forward records a graph, BI asks autograd for dL/dx and the gradients of the three
# products' outputs (retaining the graph), BW asks autograd for the weights' gradients from those. The numbers and
# even the FLOP budgets are right (autograd computes only what is asked), but nothing was derived: the check sees
# the operators that ran on tensors requiring grad (and the retained graph's tensors over the memory budget).
# EXPECT FAIL: zero_bubble

# ANSWER: zero_bubble
class SplitMLP:
    def __init__(self, w_gate, w_up, w_down):
        self.weights = [w.clone().requires_grad_() for w in (w_gate, w_up, w_down)]
        self.grad_gate, self.grad_up, self.grad_down = (torch.zeros_like(w) for w in (w_gate, w_up, w_down))
        self.saved = {}

    def forward(self, mb, x):
        wg, wu, wd = self.weights
        x = x.clone().requires_grad_()
        a, u = x @ wg.T, x @ wu.T
        h = F.silu(a) * u
        y = h @ wd.T
        self.saved[mb] = (x, a, u, h, y)
        return y.detach()

    def backward_input(self, mb, grad_y):
        x, a, u, h, y = self.saved[mb]
        dx, ga, gu = torch.autograd.grad(y, [x, a, u], grad_y, retain_graph=True)
        self.saved[mb] = (a, u, y, ga, gu, grad_y)
        return dx

    def backward_weight(self, mb):
        a, u, y, ga, gu, grad_y = self.saved.pop(mb)
        wg, wu, wd = self.weights
        (dg,) = torch.autograd.grad(a, [wg], ga, retain_graph=True)
        (du,) = torch.autograd.grad(u, [wu], gu, retain_graph=True)
        (dd,) = torch.autograd.grad(y, [wd], grad_y)
        self.grad_gate += dg
        self.grad_up += du
        self.grad_down += dd
