"""Activation recomputation's memory formulas (Korthikanti et al. 2022), term by term, for the reference GPT.

parlab/schemes/recompute/measure.py measures the model against them; the planner (parlab/schemes/hybrid/planner.py) uses
them for every plan. Plain Python, no torch: `cfg` is anything with seq_len, hidden, heads, ffn and dtype_bytes (a
GPTConfig).

Korthikanti et al.'s per-layer activation bytes (fp16, 2 bytes a number; s sequence, b batch, h hidden, a heads,
t tensor-parallel size; their section 4):
    none       s b h (34 + 5 a s / h)        TP: s b h (10 + 24/t + 5 a s / (h t))    TP+SP: s b h / t (34 + 5 a s / h)
    selective  34 s b h                      TP+SP: 34 s b h / t
    full       2 s b h                       TP+SP: 2 s b h / t
where 34 s b h = attention 11 (QKV input 2, Q and K 4, V 2, proj input 2, dropout mask 1) + MLP 19 (fc input 2,
GeLU input 8, fc2 input 8, dropout mask 1) + LayerNorm inputs 4, and 5 a s^2 b = softmax 2 + its dropout mask
1 + dropout output 2.

The same terms for the reference GPT (`activation_terms`), D bytes a number (8 in float64), F its FFN size:
  - no dropout: the two residual dropout masks (2 s b h), the attention dropout mask and output (3 a s^2 b) go;
    the softmax output is what attention-over-values keeps (D a s^2 b);
  - F need not be 4h: GeLU input and fc2 input are D s b F each (Korthikanti's 8 s b h at F = 4h, D = 2);
  - terms they neglect and autograd keeps: each LayerNorm's mean and 1/std (2 D s b per LayerNorm), and the
    causal mask, a [T, T] bool built in every layer (s^2 bytes);
so none = D s b (8 h + 2 F + 4) + D a s^2 b + s^2; selective drops the last two (q, k, v are kept as the
checkpoint's inputs: the same 3 D s b h the matmuls kept); full keeps D s b h.
Tensor parallelism (parlab/schemes/tensor_parallel.py): q, k, v, proj input, the two F-sized terms and the scores are
split over t; the LayerNorms and the inputs of the column-parallel layers are replicated. Megatron SP
(parlab/schemes/sequence/sequence_parallel.py) also splits the LayerNorms over t but, unlike Megatron-LM, keeps the
all-gathered [B, T, H] input of the column-parallel layers (Megatron-LM keeps its T/t shard and gathers it again in the
backward), so those stay whole; and its gathered tensor is a transposed view, which q, k and v each copy to a
contiguous one and keep: the QKV input is kept 3 times (measured; a .contiguous() after the gather would keep it
once). In full mode with TP the block input is replicated (D s b h), with SP split over t.
"""

from __future__ import annotations

# The modes of GPTConfig.recompute (parlab/core/models.py), written here too so that this file needs no torch (the
# planner reads it); tests/test_recompute.py checks that the two agree.
RECOMPUTE = ("none", "selective", "full")
PARALLEL = ("none", "tp", "tp+sp")  # the forms of the formulas: one device, tensor parallel, + sequence parallel


def korthikanti_bytes(cfg, batch: int, mode: str, parallel: str = "none", t: int = 1) -> float:
    """Korthikanti et al.'s activation bytes per layer as published (fp16: 2 bytes a number, dropout, F = 4h)."""
    s, b, h, a = cfg.seq_len, batch, cfg.hidden, cfg.heads
    sbh, scores = s * b * h, 5 * a * s / h
    if mode == "full":
        return 2 * sbh / (t if parallel == "tp+sp" else 1)
    if parallel == "none":
        return sbh * (34 + (scores if mode == "none" else 0))
    if parallel == "tp":
        return sbh * (10 + 24 / t + (scores / t if mode == "none" else 0))
    return sbh / t * (34 + (scores if mode == "none" else 0))


def activation_terms(cfg, batch: int, mode: str = "none", parallel: str = "none", t: int = 1) -> dict:
    """The bytes autograd keeps per layer of the reference GPT, term by term (see the module docstring).

    parallel: "none" (one device), "tp" (tensor parallel over t ranks) or "tp+sp" (+ Megatron SP): the bytes
    one rank keeps. Returns {term: bytes}; sum the values for the total.
    """
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {mode!r}")
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {list(PARALLEL)}, got {parallel!r}")
    D, s, b, h, a, F = cfg.dtype_bytes, cfg.seq_len, batch, cfg.hidden, cfg.heads, cfg.ffn
    split = t if parallel != "none" else 1  # what tensor parallelism splits: heads, FFN columns
    ln = t if parallel == "tp+sp" else 1  # what sequence parallelism splits too: the LayerNorm regions
    if mode == "full":
        return {"block input x": D * s * b * h // ln}
    terms = {
        "LayerNorm inputs (2)": 2 * D * s * b * h // ln,
        "LayerNorm mean, 1/std (2 x 2)": 4 * D * s * b // ln,
        "QKV input (LN1 output)": D * s * b * h * (3 if parallel == "tp+sp" else 1),
        "Q, K (for q k^T)": 2 * D * s * b * h // split,
        "V (for softmax x V)": D * s * b * h // split,
        "proj input": D * s * b * h // split,
        "fc input (LN2 output)": D * s * b * h,
        "GeLU input": D * s * b * F // split,
        "fc2 input (GeLU output)": D * s * b * F // split,
    }
    if mode == "none":
        terms["softmax output"] = D * a * s * s * b // split
        terms["causal mask (bool)"] = s * s
    return terms


def formula_bytes(cfg, batch: int, mode: str = "none", parallel: str = "none", t: int = 1) -> int:
    return sum(activation_terms(cfg, batch, mode, parallel, t).values())
