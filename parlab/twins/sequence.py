"""Twins of the schemes that split the sequence around attention: ring, ring-zigzag, Ulysses (and USP).

PyTorch's answer is one context manager. Inside it, every `F.scaled_dot_product_attention` runs as ring attention
on the mesh, and the buffers named are sharded along their sequence dimension in place:

    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # this rank's sequence block

The twin runs the scheme's causal attention both ways on the same q, k, v and compares the gathered outputs.
With torch 2.13 on CPU the causal case has no sharding rule (the CPU flash-attention operator): the report says
the twin was skipped and quotes torch. Where it runs (GPU), torch's ring merges its blocks with a float32
log-sum-exp, so even in float64 it agrees with exact attention to ~2.5e-7, not 1e-15 (the stated tolerance,
CP_TOL).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab.core import comm
from parlab.core.check import Verdict, compare
from parlab.twins.record import unrecorded
from parlab.twins.twin import Twin

CP_TOL = 1e-6  # context_parallel's ring vs exact attention, float64 (PITFALLS: ~2.5e-7 seen)


@contextmanager
def off_parlab_trace():
    """Run parlab's own attention inside the twin without adding its calls to the scheme's trace."""
    kept = len(comm._events)
    try:
        yield
    finally:
        del comm._events[kept:]


def qkv(opts) -> list[torch.Tensor]:
    """The same q, k, v [B, nh, T, hs] on every rank (seeded on the host), in the model's dtype, on this rank's
    device."""
    cfg, dev = opts.gpt_config(), comm.device()
    gen = torch.Generator().manual_seed(opts.seed + 7)
    shape = (opts.batch, cfg.heads, cfg.seq_len, cfg.head_size)
    draws = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]  # host: the seeded draw
    return [t.to(dev, cfg.torch_dtype) for t in draws]


def layout_of(opts) -> str:
    return "zigzag" if getattr(opts, "method", "") == "ring-zigzag" else "contiguous"


def gather_sequence(block: torch.Tensor, layout: str) -> torch.Tensor:
    """Every rank's block [B, nh, T/P, hs] back to the whole sequence [B, nh, T, hs] (untraced, for comparing)."""
    from parlab.schemes.sequence.ring_attention import zigzag_merge

    blocks = [torch.empty_like(block) for _ in range(dist.get_world_size())]
    with unrecorded():
        dist.all_gather(blocks, block.contiguous())
    return zigzag_merge(blocks, dim=2) if layout == "zigzag" else torch.cat(blocks, dim=2)


def parlab_attention(opts, q, k, v, causal: bool) -> torch.Tensor:
    """parlab's sequence-parallel attention of the scheme on this rank's block; the whole output, gathered."""
    from parlab.schemes.sequence.ring_attention import ring_attention, sequence_split

    if not hasattr(opts, "method"):  # USP: its two-level attention is checked against exact attention here
        from parlab.core.models import causal_attention

        return causal_attention(q, k, v)
    P, r, layout = dist.get_world_size(), dist.get_rank(), layout_of(opts)
    mine = [sequence_split(t, r, P, dim=2, layout=layout) for t in (q, k, v)]
    with off_parlab_trace():
        if opts.method == "ulysses":
            from parlab.schemes.sequence.ulysses import ulysses_attention

            out = ulysses_attention(*mine, causal=causal)
        else:
            out = ring_attention(*mine, causal=causal, layout=layout)
    return gather_sequence(out, layout)


def torch_attention(q, k, v, causal: bool) -> torch.Tensor:
    """context_parallel's SDPA on the same q, k, v; the whole output, gathered (its layout is contiguous)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(comm.device().type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v = (t.clone() for t in (q, k, v))  # context_parallel shards its buffers in place
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return gather_sequence(out, "contiguous")


def cp_rank(opts, value) -> dict:
    """context_parallel on the causal attention the scheme computes, and parlab's, on the same q, k, v.

    On CPU torch refuses the causal mask (NotImplementedError, raised on every rank before any traffic, so the
    ranks stay in step): the report quotes it. Without the mask it runs, but on this 2-core machine DTensor's
    sharding propagation through SDPA's decomposition takes longer than a launch's timeout."""
    q, k, v = qkv(opts)
    try:
        theirs = torch_attention(q, k, v, causal=True)
    except NotImplementedError as exc:
        return {"error": f"NotImplementedError: {str(exc).strip().splitlines()[0]}"}
    return {"torch": theirs, "parlab": parlab_attention(opts, q, k, v, causal=True)}


def cp_compare(opts, results, outs) -> list[Verdict]:
    return [
        compare(
            f"parlab's {getattr(opts, 'method', 'usp')} attention (causal, same q, k, v), rank {r}",
            o["parlab"],
            o["torch"],
            CP_TOL,
            against="torch context_parallel",
        )
        for r, o in enumerate(outs)
    ]


CP = Twin("torch context_parallel (SDPA)", cp_rank, cp_compare)
TWINS = {"ring": CP, "ring-zigzag": CP, "ulysses": CP, "usp": CP}
