"""Lab 07's reference: the lab model's layout on a dp x pp x tp mesh, and every count the checks make from it.

The checks of parlab/grading/labs/lab07_hybrid.py deal the weights, count the bytes and predict with the functions
here, at the lab's sizes and at a Llama-like model's. They are the answers of parts 1 and 2 and of the predictions,
so this file is on the lab's `LIBRARY`: an answer that calls into it is a FAIL line naming the call.

The lab model's tensor-parallel layout (Megatron's, for grouped-query attention), rank t of T on the tp axis:

    q, o           query heads [t nq/T, (t+1) nq/T): rows of q, the same columns of o
    k, v           the K/V heads those query heads read: nkv/T of them when T <= nkv; when T > nkv one head,
                   the same on the T/nkv ranks whose query heads share it (replicated: their gradients are partial
                   sums, summed over those ranks: the "K/V group")
    gate, up, down rows [t F/T, (t+1) F/T) of gate and up, the same columns of down
    embed, head    rows [t V/T, (t+1) V/T) (vocabulary-parallel); the RMSNorm gains whole on every rank
"""

from __future__ import annotations

import functools
import math

import torch

from parlab.core.lab_model import LabConfig, LabModel
from parlab.core.mesh import mesh_coords, mesh_rank

# The lab model at the lab's size: 8 query heads of 6 numbers, 2 K/V heads, 4 blocks; float64.
CFG = LabConfig(vocab_size=64, seq_len=8, hidden=48, heads=8, kv_heads=2, ffn=64, layers=4)
B = 4  # the step's global batch: x, target [B, T, H] (T = CFG.seq_len)

# Parts 2 and 3: two layouts of 8 live ranks. The second has more tp ranks than K/V heads (each K/V head on two
# ranks), and tp slowest, so that a K/V group is not a block of consecutive ranks.
STEP_MESHES = [
    {"dp": 2, "pp": 2, "tp": 2},
    {"tp": 4, "dp": 2, "pp": 1},
]
KINDS = ("params", "grads", "optimizer")

# The prediction at scale: a Llama-like GQA model (Llama 3 70B's sizes) on 1024 GPUs, TP 8 x PP 8 x DP 16 (pp
# slowest, as Megatron-LM orders it), ZeRO-1 over dp, mixed precision: 2 + 2 + 12 bytes per parameter.
LLAMA = LabConfig(vocab_size=128256, seq_len=8192, hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80)
LLAMA_AXES = {"pp": 8, "dp": 16, "tp": 8}
MIXED = (2, 2, 12)

# ------------------------------------------------------------------------------------------------ the layout


@functools.cache
def full_shapes(cfg: LabConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the lab model `cfg` and its shape (built on the meta device: no memory, any size)."""
    with torch.device("meta"):
        model = LabModel(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def layout(cfg: LabConfig, axes: dict[str, int], rank: int) -> dict[str, tuple[int, int, int] | None]:
    """What `rank` holds of the lab model on the mesh `axes` (with dp, pp and tp): {name: (dim, start, stop)}, its
    piece of the tensor (indices [start, stop) along dim), or None for a tensor it holds whole."""
    c = mesh_coords(rank, axes)
    s, S, t, T = c.get("pp", 0), axes.get("pp", 1), c.get("tp", 0), axes.get("tp", 1)
    hd, nq, nkv, F, V = cfg.head_size, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab_size
    q = (0, t * nq // T * hd, (t + 1) * nq // T * hd)  # its query heads' rows
    if T <= nkv:  # nkv / T K/V heads of its own
        kv = (0, t * nkv // T * hd, (t + 1) * nkv // T * hd)
    else:  # the one K/V head its query heads read, the same on the T / nkv ranks that share it
        j = t * nkv // T
        kv = (0, j * hd, (j + 1) * hd)
    ffn, vocab = (0, t * F // T, (t + 1) * F // T), (0, t * V // T, (t + 1) * V // T)
    held: dict[str, tuple[int, int, int] | None] = {}
    if s == 0:
        held["embed.weight"] = vocab
    per = cfg.layers // S
    for i in range(s * per, (s + 1) * per):
        p = f"blocks.{i}."
        held |= {
            p + "attn_norm.weight": None,
            p + "attn.q.weight": q,
            p + "attn.k.weight": kv,
            p + "attn.v.weight": kv,
            p + "attn.o.weight": (1, q[1], q[2]),
            p + "mlp_norm.weight": None,
            p + "mlp.gate.weight": ffn,
            p + "mlp.up.weight": ffn,
            p + "mlp.down.weight": (1, ffn[1], ffn[2]),
        }
    if s == S - 1:
        held["norm.weight"] = None
        if not cfg.tied:
            held["head.weight"] = vocab
    return held


def held_shapes(cfg: LabConfig, axes: dict[str, int], rank: int) -> dict[str, list[int]]:
    """The shape of each piece `rank` holds."""
    full, out = full_shapes(cfg), {}
    for name, where in layout(cfg, axes, rank).items():
        shape = list(full[name])
        if where is not None:
            shape[where[0]] = where[2] - where[1]
        out[name] = shape
    return out


def held_states(cfg: LabConfig, axes: dict[str, int], rank: int, bytes_per=None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states `rank` holds with ZeRO-1 over dp: its pieces whole,
    their gradients whole, 1/D of the optimizer states. bytes_per: (param, grad, optimizer) bytes per number;
    default the model's dtype with Adam's master, m and v in it."""
    psi = sum(math.prod(shape) for shape in held_shapes(cfg, axes, rank).values())
    p, g, k = bytes_per or (cfg.dtype_bytes, cfg.dtype_bytes, 3 * cfg.dtype_bytes)
    return {"params": psi * p, "grads": psi * g, "optimizer": psi * k // axes.get("dp", 1)}


def layouts_of(world: int, cfg: LabConfig = CFG) -> list[dict[str, int]]:
    """Every dp x pp x tp layout of `world` ranks the lab model splits into: whole heads, FFN rows, vocabulary rows
    and blocks per rank, and tp a divisor or a multiple of the K/V heads."""
    found = []
    for tp in range(1, world + 1):
        whole = all(n % tp == 0 for n in (cfg.heads, cfg.ffn, cfg.vocab_size))
        if not whole or (cfg.kv_heads % tp and tp % cfg.kv_heads):
            continue
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) == 0 and cfg.layers % pp == 0:
                found.append({"dp": world // (tp * pp), "pp": pp, "tp": tp})
    return found


# ------------------------------------------------------------------------------------------------ the groups


def row_major_group(rank: int, axes: dict[str, int], axis: str) -> list[int]:
    """The ranks of `rank`'s group along `axis` in torch's layout: torch.arange(world).view(sizes), row-major."""
    grid = torch.arange(math.prod(axes.values())).view(*axes.values())  # host: rank numbers, no data
    rows = grid.movedim(list(axes).index(axis), -1).reshape(-1, axes[axis])  # every group along `axis`, one a row
    return next(row.tolist() for row in rows if rank in row.tolist())


def kv_ranks(rank: int, axes: dict[str, int], heads: int, kv_heads: int) -> list[int]:
    """The ranks that hold the same K/V heads as `rank` (itself included), in tp order: its tp partners whose
    query heads read the same K/V head when tp > kv_heads; itself alone otherwise."""
    tp = row_major_group(rank, axes, "tp")
    T, t = len(tp), tp.index(rank)
    if T <= kv_heads:
        return [rank]
    return [r for u, r in enumerate(tp) if u * kv_heads // T == t * kv_heads // T]


def own_groups(axes: dict[str, int], rank: int) -> dict[str, list[int]]:
    """The rank's groups: one per axis of the mesh, and the ranks sharing its K/V head."""
    groups = {axis: sorted(row_major_group(rank, axes, axis)) for axis in ("tp", "pp", "dp")}
    return groups | {"kv": sorted(kv_ranks(rank, axes, CFG.heads, CFG.kv_heads))}


def step_theory(axes: dict[str, int], rank: int) -> dict:
    """What `rank` hands to each of its groups in one step (payload bytes): all-reduces on tp, dp and its K/V
    group, and (op, stage step, bytes) of each send and receive on pp."""
    c, e = mesh_coords(rank, axes), CFG.dtype_bytes
    S, D, T = axes["pp"], axes["dp"], axes["tp"]
    s, blocks = c["pp"], CFG.layers // S
    message = B // D * CFG.seq_len * CFG.hidden * e  # one [b, T, H] activation or its gradient
    sends = ([("send", +1)] if s < S - 1 else []) + ([("send", -1)] if s > 0 else [])
    recvs = ([("recv", -1)] if s > 0 else []) + ([("recv", +1)] if s < S - 1 else [])
    shapes = {name: shape for name, shape in held_shapes(CFG, axes, rank).items() if name.startswith("blocks.")}
    k_numel = math.prod(next(shape for name, shape in shapes.items() if name.endswith("attn.k.weight")))
    shared = len(kv_ranks(rank, axes, CFG.heads, CFG.kv_heads)) > 1
    return {
        "tp": 4 * blocks * message if T > 1 else 0,  # per block: g forward and f backward, attention and MLP
        "pp": sorted((op, step, message) for op, step in sends + recvs),
        "dp": sum(math.prod(shape) for shape in shapes.values()) * e if D > 1 else 0,  # every gradient of its blocks
        "kv": 2 * blocks * k_numel * e if shared else 0,  # the K and V gradients of each block
    }


# ------------------------------------------------------------------------------------------- the predictions


def _rank0(per_mesh: list[dict]) -> dict:
    """The four quantities of the prediction, from rank 0's per-group bytes on the two meshes."""
    a, b = per_mesh
    return {
        "tp_bytes": a["tp"],
        "pp_bytes": sum(n for op, _, n in a["pp"] if op == "send"),
        "dp_bytes": a["dp"],
        "kv_bytes": b["kv"],
    }


def traffic_theory() -> dict:
    """The prediction's theory: rank 0's payload per group in one step, on each of the two meshes."""
    return _rank0([step_theory(axes, 0) for axes in STEP_MESHES])


def memory_at_scale_theory() -> dict:
    """The model-state GB of the busiest GPU of the Llama-like model on LLAMA_AXES, ZeRO-1, mixed precision."""
    stages = [mesh_rank({"pp": s, "dp": 0, "tp": 0}, LLAMA_AXES) for s in range(LLAMA_AXES["pp"])]  # tp ranks: alike
    busiest = max(sum(held_states(LLAMA, LLAMA_AXES, rank, MIXED).values()) for rank in stages)
    return {"gb": busiest / 1e9}


THEORY = {"traffic": traffic_theory, "memory_at_scale": memory_at_scale_theory}
