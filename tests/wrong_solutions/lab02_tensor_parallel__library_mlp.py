# ruff: noqa
# A wrong answer to labs/lab02_tensor_parallel.ipynb (the other answers are the solution's). The bug: the library's
# TensorParallelMLP with its GELU swapped for SwiGLU (its column- and row-parallel linears, f and g inside), on the
# sequence gathered with part 1's pair, each rank keeping its tokens of the all-reduced output. y is exact, but the
# linears are the library's (the FAIL line names the calls), and the sequence is gathered whole.
# EXPECT FAIL: swiglu

# ANSWER: swiglu
from parlab.schemes.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP


def _linear(w):
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)
    layer.weight = nn.Parameter(w.clone())
    return layer


class SwiGLUParallel(TensorParallelMLP):
    def __init__(self, gate, up, down):
        nn.Module.__init__(self)
        self.label, self.group = "mlp", None
        self.gate = ColumnParallelLinear(_linear(gate), copy_input=False)
        self.up = ColumnParallelLinear(_linear(up), copy_input=False)
        self.proj = RowParallelLinear(_linear(down))

    def forward(self, x):
        return self.proj(F.silu(self.gate(x)) * self.up(x))


def swiglu(x, gate, up, down, layout):
    whole = gather_tokens(x, layout)  # [B, T, H]
    return SwiGLUParallel(gate, up, down)(whole)[:, layout[dist.get_rank()]]
