"""Lab 07's reference: where the mesh's ranks sit on the nodes, what each rank of a dp x pp x tp mesh holds of the
lab model, what it sends in a step, the plan that fits a memory budget, and every count the prediction makes.

The checks of parlab/grading/labs/lab07_hybrid.py place, deal, count and choose with the functions here. They are
the answers of parts 1 and 3 and of the prediction, so this file is on the lab's `LIBRARY`: an answer that calls
into it is a FAIL line naming the call.

The lab model here has nq = 12 query heads and nkv = 3 K/V heads: query head h reads K/V head h // 4. Its
tensor-parallel layout (Megatron's, for grouped-query attention), rank t of T on the tp axis:

    q, o           query heads [t nq/T, (t+1) nq/T): rows of q, the same columns of o
    k, v           every K/V head those query heads read, and only those: with T = 2 or 4 a K/V head's query heads
                   fall on two tp places, and both hold a copy of it (its gradient is a partial sum on each: the
                   copies' gradients are summed over the ranks that hold it, that head's "K/V group")
    gate, up, down rows [t F/T, (t+1) F/T) of gate and up, the same columns of down
    embed, head    rows [t V/T, (t+1) V/T) (vocabulary-parallel); the RMSNorm gains whole on every rank
    tied head      (cfg.tied) the head is embed.weight: with more than one stage the last stage keeps its own copy
                   of its rows (Megatron's), and the two copies' gradients are summed by the first and the last
                   stage's ranks of the same (dp, tp) place
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from parlab.core.lab_model import LabConfig, LabModel
from parlab.core.mesh import mesh_coords

# The lab model at the lab's size: 12 query heads of 4 numbers on 3 K/V heads, 4 blocks; float64. Part 3 plans it
# untied (CFG) and with its head tied to its embedding (TIED, as Llama 3.2 1B and 3B are).
CFG = LabConfig(vocab_size=96, seq_len=8, hidden=48, heads=12, kv_heads=3, ffn=96, layers=4)
TIED = LabConfig(vocab_size=96, seq_len=8, hidden=48, heads=12, kv_heads=3, ffn=96, layers=4, tied=True)
B = 8  # the step's global batch: x, target [B, T, H] (T = CFG.seq_len); a replica trains on B / D rows

# Part 2 (the step): three layouts of 8 live ranks. In the first a K/V head straddles the two tp places; in the
# second (tp slowest, tp = 4) the three K/V heads overlap in a chain: K/V head 1 on tp places 1 and 2, and so on;
# the third has stages in the middle (pp = 4, one block each), which receive their input and send it on.
STEP_MESHES = [
    {"dp": 2, "pp": 2, "tp": 2},
    {"tp": 4, "dp": 2, "pp": 1},
    {"pp": 4, "tp": 2, "dp": 1},
]
KINDS = ("params", "grads", "optimizer")
ZERO_STAGES = (0, 1, 2, 3)

# The traffic prediction: part 2's first mesh with twice the check's batch, on 4 nodes of 2 GPUs whose launcher
# numbers the ranks cyclically. At this batch tp hands over more than dp (at the check's batch, less): only one axis'
# groups fit in a node of 2, and which one is the payloads' call.
TRAFFIC_MESH = STEP_MESHES[0]
TRAFFIC_GPUS, TRAFFIC_NUMBERING, TRAFFIC_BATCH = 2, "cyclic", 16

# ------------------------------------------------------------------------------------------------ the heads


def query_heads(t: int, T: int, heads: int) -> range:
    """The query heads of tp place t of T: [t nq/T, (t+1) nq/T)."""
    return range(t * heads // T, (t + 1) * heads // T)


def kv_span(t: int, T: int, heads: int, kv_heads: int) -> range:
    """The K/V heads tp place t holds: every one its query heads read (query head h reads h // (nq/nkv))."""
    q = query_heads(t, T, heads)
    return range(q[0] * kv_heads // heads, q[-1] * kv_heads // heads + 1)


def kv_holders(tp_ranks: list[int], heads: int, kv_heads: int) -> dict[int, list[int]]:
    """For each K/V head, the ranks of the tp group `tp_ranks` (global ranks, in tp order) that hold a copy of it,
    in tp order."""
    T = len(tp_ranks)
    return {j: [r for t, r in enumerate(tp_ranks) if j in kv_span(t, T, heads, kv_heads)] for j in range(kv_heads)}


# --------------------------------------------------------------------------------------------- the placement


def node_of(rank: int, world: int, gpus: int, numbering: str) -> int:
    """The node of global rank `rank` when the launcher numbers `world` ranks on nodes of `gpus` GPUs node by node
    ("block": torchrun's) or round-robin over the nodes ("cyclic": SLURM's --distribution=cyclic)."""
    return rank // gpus if numbering == "block" else rank % (world // gpus)


def least_nodes(
    axes: dict[str, int], gpus: int, payload: dict[str, float]
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The least spans, heaviest axis first (the nodes each axis' groups span, added up over its groups, compared
    as a tuple: the heaviest axis' first), and nodes that reach it: each node a tuple of cells (indices of the
    coordinates in row-major order of `axes`).

    An exact search, not a rule: heaviest axis fastest is the least only when the sizes nest (2 x 3 with the 3
    heavier on nodes of 2 spans (4, 6) that way, (4, 5) at best). The cells are dealt out node by node, the node
    of the first cell left chosen among every set of G - 1 others; the spans of the nodes add up, so the least for
    the cells left is a subproblem of its own (memoised on the set of cells left: a few thousand sets at 12 ranks)."""
    names = sorted(axes, key=lambda axis: -payload[axis])
    cells = list(itertools.product(*(range(n) for n in axes.values())))
    group_of = [[c[:k] + c[k + 1 :] for k in (list(axes).index(axis) for axis in names)] for c in cells]

    @functools.cache
    def cost(node: tuple[int, ...]) -> tuple[int, ...]:  # per axis: the groups that reach into this node
        return tuple(len(set(groups)) for groups in zip(*(group_of[i] for i in node), strict=True))

    @functools.cache
    def best(left: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        if not left:
            return (0,) * len(names), ()
        first, others = left[0], left[1:]
        found = None
        for mates in itertools.combinations(others, gpus - 1):
            node = (first, *mates)
            spans, nodes = best(tuple(i for i in others if i not in mates))
            total = tuple(x + y for x, y in zip(cost(node), spans, strict=True))
            if found is None or total < found[0]:
                found = (total, (node, *nodes))
        return found

    return best(tuple(range(len(cells))))


def placement(axes: dict[str, int], gpus: int, numbering: str, payload: dict[str, float]) -> list:
    """The mesh (nested lists in the order of `axes`: mesh[i][j][k] the global rank at those coordinates) whose
    groups span the fewest nodes, the heaviest axis' first (least_nodes), each node's GPUs given the launcher's
    numbers: node n holds ranks nG .. nG + G - 1 ("block") or n, n + N, n + 2N, ... ("cyclic")."""
    world = math.prod(axes.values())
    nodes = world // gpus
    _, chosen = least_nodes(axes, gpus, payload)
    grid = torch.empty(world, dtype=torch.long)  # host: rank numbers, no data
    for n, node in enumerate(chosen):
        for slot, cell in enumerate(node):
            grid[cell] = n * gpus + slot if numbering == "block" else slot * nodes + n
    return grid.view(*axes.values()).tolist()


def mesh_groups(mesh, axes: dict[str, int], axis: str) -> list[list[int]]:
    """Every group of the mesh (nested lists of global ranks) along `axis`, each in axis order."""
    grid = torch.tensor(mesh)  # host: rank numbers, no data
    return grid.movedim(list(axes).index(axis), -1).reshape(-1, axes[axis]).tolist()


def spans(groups: list[list[int]], gpus: int, numbering: str) -> int:
    """The nodes the groups span, added up over the groups (a group on one node counts 1)."""
    world = sum(len(g) for g in groups)
    return sum(len({node_of(r, world, gpus, numbering) for r in group}) for group in groups)


def row_major_group(rank: int, axes: dict[str, int], axis: str) -> list[int]:
    """The ranks of `rank`'s group along `axis` in torch's layout: torch.arange(world).view(sizes), row-major."""
    grid = torch.arange(math.prod(axes.values())).view(*axes.values())  # host: rank numbers, no data
    return next(g for g in mesh_groups(grid.tolist(), axes, axis) if rank in g)


# ------------------------------------------------------------------------------------------------ the layout


@functools.cache
def full_shapes(cfg: LabConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the lab model `cfg` and its shape (built on the meta device: no memory, any size)."""
    with torch.device("meta"):
        model = LabModel(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def stage_blocks(layers: int, S: int, s: int) -> range:
    """The blocks of pipeline stage s of S: L/S consecutive ones."""
    if layers % S:
        raise ValueError(f"{layers} blocks do not split over {S} stages")
    per = layers // S
    return range(s * per, (s + 1) * per)


def layout(cfg: LabConfig, axes: dict[str, int], rank: int) -> dict[str, tuple[int, int, int] | None]:
    """What `rank` holds of the lab model on the mesh `axes` (row-major, with dp, pp and tp): {name: (dim, start,
    stop)}, its piece of the tensor (indices [start, stop) along dim), or None for a tensor it holds whole."""
    c = mesh_coords(rank, axes)
    s, S, t, T = c.get("pp", 0), axes.get("pp", 1), c.get("tp", 0), axes.get("tp", 1)
    hd, F, V = cfg.head_size, cfg.ffn, cfg.vocab_size
    q = query_heads(t, T, cfg.heads)
    kv = kv_span(t, T, cfg.heads, cfg.kv_heads)
    q_rows, kv_rows = (0, q.start * hd, q.stop * hd), (0, kv.start * hd, kv.stop * hd)
    ffn, vocab = (0, t * F // T, (t + 1) * F // T), (0, t * V // T, (t + 1) * V // T)
    held: dict[str, tuple[int, int, int] | None] = {}
    if s == 0:
        held["embed.weight"] = vocab
    for i in stage_blocks(cfg.layers, S, s):
        p = f"blocks.{i}."
        held |= {
            p + "attn_norm.weight": None,
            p + "attn.q.weight": q_rows,
            p + "attn.k.weight": kv_rows,
            p + "attn.v.weight": kv_rows,
            p + "attn.o.weight": (1, q_rows[1], q_rows[2]),
            p + "mlp_norm.weight": None,
            p + "mlp.gate.weight": ffn,
            p + "mlp.up.weight": ffn,
            p + "mlp.down.weight": (1, ffn[1], ffn[2]),
        }
    if s == S - 1:
        held["norm.weight"] = None
        held["embed.weight" if cfg.tied else "head.weight"] = vocab  # tied, S > 1: the last stage's own copy
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


def held_numel(cfg: LabConfig, axes: dict[str, int], rank: int) -> int:
    """Psi_r: the numbers `rank` holds (parameters)."""
    return sum(math.prod(shape) for shape in held_shapes(cfg, axes, rank).values())


def _exact(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def held_states(cfg: LabConfig, axes: dict[str, int], rank: int, zero: int) -> dict[str, int | float]:
    """Bytes of parameters, gradients and optimizer states `rank` holds with ZeRO stage `zero` (0 = none) over its
    dp group: stage 1 shares out the optimizer states, 2 the gradients too, 3 the parameters too; all in the
    model's dtype, Adam's master weights, m and v among the optimizer states."""
    psi, D = held_numel(cfg, axes, rank), axes.get("dp", 1)
    p, g, k = cfg.dtype_bytes, cfg.dtype_bytes, 3 * cfg.dtype_bytes
    return {
        "params": _exact(psi * p / (D if zero >= 3 else 1)),
        "grads": _exact(psi * g / (D if zero >= 2 else 1)),
        "optimizer": _exact(psi * k / (D if zero >= 1 else 1)),
    }


def layouts_of(world: int, cfg: LabConfig = CFG, batch: int = B) -> list[dict[str, int]]:
    """Every dp x pp x tp layout of `world` ranks the lab model and the batch split into: whole query heads, FFN
    rows and vocabulary rows per tp rank, whole blocks per stage, whole rows per replica."""
    found = []
    for tp in range(1, world + 1):
        if world % tp or any(n % tp for n in (cfg.heads, cfg.ffn, cfg.vocab_size)):
            continue
        for pp in range(1, world // tp + 1):
            dp = world // (tp * pp)
            if world % (tp * pp) == 0 and cfg.layers % pp == 0 and batch % dp == 0:
                found.append({"dp": dp, "pp": pp, "tp": tp})
    return found


# ---------------------------------------------------------------------------------------- a step's traffic


def message_bytes(cfg: LabConfig, axes: dict[str, int], batch: int = B) -> int:
    """One activation [b, T, H] of a replica (b = B / D rows), or its gradient."""
    return batch // axes.get("dp", 1) * cfg.seq_len * cfg.hidden * cfg.dtype_bytes


def step_theory(axes: dict[str, int], rank: int, cfg: LabConfig = CFG, batch: int = B) -> dict:
    """What `rank` hands to torch.distributed in one step of part 2 (payload bytes): {"allreduce": {the sorted
    ranks of a group: bytes}, "pp": sorted (op, stage step, bytes) of its sends and receives}. A group of one rank
    moves nothing and is left out; a K/V group with the same ranks as the tp group adds to it."""
    c, e = mesh_coords(rank, axes), cfg.dtype_bytes
    S, T = axes.get("pp", 1), axes.get("tp", 1)
    s, t = c.get("pp", 0), c.get("tp", 0)
    blocks = len(stage_blocks(cfg.layers, S, s))
    message = message_bytes(cfg, axes, batch)
    tp = row_major_group(rank, axes, "tp")
    out: dict[tuple[int, ...], int] = {}

    def add(ranks: list[int], n: int) -> None:
        if len(ranks) > 1 and n:
            key = tuple(sorted(ranks))
            out[key] = out.get(key, 0) + n

    add(tp, 4 * blocks * message)  # per block: g forward and f backward, of attention and of the MLP
    holders = kv_holders(tp, cfg.heads, cfg.kv_heads)
    for j in kv_span(t, T, cfg.heads, cfg.kv_heads):  # the K and V gradients of each shared head, on its holders
        add(holders[j], blocks * 2 * cfg.head_size * cfg.hidden * e)
    shapes = {name: shape for name, shape in held_shapes(cfg, axes, rank).items() if name.startswith("blocks.")}
    add(row_major_group(rank, axes, "dp"), sum(math.prod(shape) for shape in shapes.values()) * e)
    sends = ([("send", +1)] if s < S - 1 else []) + ([("send", -1)] if s > 0 else [])
    recvs = ([("recv", -1)] if s > 0 else []) + ([("recv", +1)] if s < S - 1 else [])
    return {"allreduce": out, "pp": sorted((op, step, message) for op, step in sends + recvs)}


def ring(n: int) -> float:
    """What each rank of n sends on the wire in a ring all-reduce, per byte of payload: 2 (n-1)/n."""
    return 2 * (n - 1) / n


def wire_bytes(cfg: LabConfig, axes: dict[str, int], rank: int, zero: int, batch: int = B) -> int | float:
    """The bytes `rank` sends on the wire in one step of the plan: part 2's step (the blocks' f and g, the K/V
    sums, the pipeline's sends), the sum of a tied head's two copies (an all-reduce of the whole [V/T, H] gradient
    piece on the first and the last stage's ranks of the same (dp, tp) place) and the synchronisation over dp of
    the gradients of everything it holds (ZeRO 0: an all-reduce; 1 and 2: a reduce-scatter and an all-gather of
    the updated parameters; 3: an all-gather before the forward, another before the backward, a reduce-scatter),
    ring algorithms. The embedding lookup's and the loss's own tp collectives are not counted."""
    c, e = mesh_coords(rank, axes), cfg.dtype_bytes
    S, D, T = axes.get("pp", 1), axes.get("dp", 1), axes.get("tp", 1)
    s, t = c.get("pp", 0), c.get("tp", 0)
    blocks = len(stage_blocks(cfg.layers, S, s))
    message = message_bytes(cfg, axes, batch)
    sent = 4 * blocks * ring(T) * message + ((s < S - 1) + (s > 0)) * message
    holders = kv_holders(list(range(T)), cfg.heads, cfg.kv_heads)
    for j in kv_span(t, T, cfg.heads, cfg.kv_heads):
        sent += blocks * 2 * ring(len(holders[j])) * cfg.head_size * cfg.hidden * e
    if cfg.tied and S > 1 and s in (0, S - 1):  # the two copies of the tied matrix: a ring of 2
        sent += ring(2) * cfg.vocab_size // T * cfg.hidden * e
    gathers_and_scatters = {0: 2, 1: 2, 2: 2, 3: 3}[zero]  # in units of (D-1)/D of the rank's gradient bytes
    sent += gathers_and_scatters * (D - 1) / D * held_numel(cfg, axes, rank) * e
    return _exact(sent)


# ------------------------------------------------------------------------------------------------ the plan


MAX_BUBBLE = 0.25  # a plan's pipeline may idle at most this fraction of the step


def pipeline_bubble(S: int, m: int) -> float:
    """The idle fraction (S-1)/(m+S-1) of S stages running m micro-batches under 1F1B (lesson 03)."""
    return (S - 1) / (m + S - 1)


def bubble(axes: dict[str, int], batch: int = B) -> float:
    """The least idle fraction of a layout: a replica's b = B/D rows go through its pipeline as m = b
    micro-batches of one row, the most there can be (the bytes sent do not depend on m: the same rows pass)."""
    return pipeline_bubble(axes.get("pp", 1), batch // axes.get("dp", 1))


def plans_of(world: int, cfg: LabConfig = CFG, batch: int = B) -> list[tuple[dict[str, int], int]]:
    """Every (layout, ZeRO stage) of `world` ranks whose bubble is at most MAX_BUBBLE; ZeRO only where there is a
    dp axis to share over."""
    return [
        (axes, z)
        for axes in layouts_of(world, cfg, batch)
        if bubble(axes, batch) <= MAX_BUBBLE
        for z in ZERO_STAGES
        if z == 0 or axes["dp"] > 1
    ]


def busiest(cfg: LabConfig, axes: dict[str, int], zero: int, batch: int = B) -> tuple[float, float]:
    """(the most bytes any rank sends in a step, the most bytes of model states any rank holds)."""
    world = math.prod(axes.values())
    sent = max(wire_bytes(cfg, axes, r, zero, batch) for r in range(world))
    held = max(sum(held_states(cfg, axes, r, zero).values()) for r in range(world))
    return sent, held


def best_plan(world: int, budget: float, cfg: LabConfig = CFG, batch: int = B):
    """The plan whose every rank's model states fit in `budget` bytes and whose rank that sends the most sends the
    fewest bytes in a step; of plans that send the same, the one whose rank that holds the most holds the least;
    then the lowest ZeRO stage, the fewest stages. None when no plan fits."""
    scored = []
    for axes, zero in plans_of(world, cfg, batch):
        sent, held = busiest(cfg, axes, zero, batch)
        if held <= budget:
            scored.append(((round(sent, 6), held, zero, axes["pp"]), axes, zero))
    if not scored:
        return None
    scored.sort(key=lambda item: item[0])
    return scored[0][1], scored[0][2]


# ------------------------------------------------------------------------------------------- the predictions


def step_payload(axes: dict[str, int], rank: int, batch: int = B) -> dict[str, int]:
    """`rank`'s payload per axis in part 2's step (the K/V sums on the tp ranks counted with tp; a pp rank's
    sends): the table part 1 places by."""
    theory = step_theory(axes, rank, batch=batch)
    out = {}
    for axis in axes:
        if axis == "pp":
            out[axis] = sum(n for op, _, n in theory["pp"] if op == "send")
        else:
            out[axis] = theory["allreduce"].get(tuple(sorted(row_major_group(rank, axes, axis))), 0)
    return out


def crossing_bytes(calls: list[dict], node: list[int]) -> float:
    """The bytes that leave node 0 in one step. calls[r]: rank r's {"allreduce": {sorted ranks of a group:
    payload}, "sends": [(peer, bytes)]}. An all-reduce is a ring in the group's order: each rank sends the next
    2 (n-1)/n of the payload (on a group of 2: the whole payload to its partner). node[r]: the node of rank r of
    the step's (row-major) mesh."""
    out = 0.0
    for rank, mine in enumerate(calls):
        if node[rank] != 0:
            continue
        for ranks, n in mine["allreduce"].items():
            following = ranks[(ranks.index(rank) + 1) % len(ranks)]
            out += ring(len(ranks)) * n if node[following] != 0 else 0
        out += sum(n for peer, n in mine["sends"] if node[peer] != 0)
    return _exact(out)


def theory_calls(axes: dict[str, int], rank: int, batch: int = B) -> dict:
    """step_theory's calls of `rank` in crossing_bytes' form (each send with its global peer)."""
    theory, pp = step_theory(axes, rank, batch=batch), row_major_group(rank, axes, "pp")
    s = pp.index(rank)
    return {"allreduce": theory["allreduce"], "sends": [(pp[s + st], n) for op, st, n in theory["pp"] if op == "send"]}


def traffic_nodes() -> dict[str, list[int]]:
    """The node of each rank of the prediction's row-major mesh: torch's row-major mesh laid over the launcher's
    cyclic numbering ("naive"), and part 1's placement for the step's own payloads at the prediction's batch
    ("placed")."""
    axes, world = TRAFFIC_MESH, math.prod(TRAFFIC_MESH.values())
    naive = [node_of(r, world, TRAFFIC_GPUS, TRAFFIC_NUMBERING) for r in range(world)]
    payload = step_payload(axes, 0, TRAFFIC_BATCH)
    mesh = torch.tensor(placement(axes, TRAFFIC_GPUS, TRAFFIC_NUMBERING, payload))  # host: rank numbers
    placed = [
        node_of(int(mesh[tuple(mesh_coords(r, axes).values())]), world, TRAFFIC_GPUS, TRAFFIC_NUMBERING)
        for r in range(world)
    ]
    return {"naive": naive, "placed": placed}


def traffic_theory() -> dict:
    """The prediction's theory: the bytes that leave node 0 in one step at the prediction's batch, naive and
    placed."""
    calls = [theory_calls(TRAFFIC_MESH, r, TRAFFIC_BATCH) for r in range(math.prod(TRAFFIC_MESH.values()))]
    nodes = traffic_nodes()
    return {
        "naive_bytes": crossing_bytes(calls, nodes["naive"]),
        "placed_bytes": crossing_bytes(calls, nodes["placed"]),
    }


THEORY = {"traffic": traffic_theory}
