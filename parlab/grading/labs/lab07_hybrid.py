"""Lab 07's checks: a mesh placed on nodes with the fewest nodes under each axis' groups, one hybrid training step of
the lab model's blocks with each collective on its group (the ranks that share a K/V head among them), the bytes
that cross between nodes, and the plan (layout and ZeRO stage) that fits a memory budget with the fewest bytes sent,
for the model untied and tied (see parlab/grading for collect_/judge_).

The model is the labs' own (parlab/core/lab_model.py) with 12 query heads on 3 K/V heads, so that a tp of 2 or 4
cuts a K/V head's query heads between two tp places: both hold a copy, its gradient a partial sum on each. Its
layout on the mesh (which rank holds which piece), and every count made from it, are in
parlab/grading/labs/lab07_layout.py, the reference: on the lab's LIBRARY. Every call the step makes into
torch.distributed is recorded at the process group, with the global ranks of that group (`recording`), so the
checks see which group each call used; calls into the library's own hybrid code (and into the reference) are seen
too (`LIBRARY`, parlab/grading/labs/guard.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model
from parlab.core.mesh import DeviceMesh, mesh_coords
from parlab.grading.labs import error_summary, lab07_layout, prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab07_layout import (
    CFG,
    KINDS,
    MAX_BUBBLE,
    STEP_MESHES,
    TIED,
    TRAFFIC_BATCH,
    TRAFFIC_MESH,
    ZERO_STAGES,
    B,
    best_plan,
    busiest,
    crossing_bytes,
    kv_holders,
    layout,
    layouts_of,
    least_nodes,
    mesh_groups,
    node_of,
    pipeline_bubble,
    row_major_group,
    spans,
    step_theory,
    traffic_nodes,
    traffic_theory,
)
from parlab.schemes.tensor_parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel
from parlab.schemes.zero.stages import ZeRO

LAUNCH = {"timeout": 30, "echo": False}  # a hang (a call some rank never matches) is diagnosed after 30 s
WORLD = 8

# What the parts must not call: the library's mesh arithmetic (part 1 only: later parts may use parlab's mesh, the
# step receives one), its hybrid scheme, planner and the pieces they compose, the lesson helpers around them, and
# this lab's own reference (the answers of parts 1 and 3 and of the predictions).
LIBRARY = (
    "core/mesh.py",
    "grading/labs/lab07_layout.py",
    "schemes/hybrid/",
    "schemes/pipeline/",
    "schemes/data_parallel.py",
    "schemes/zero/",
    "lessons/hybrid.py",
    "lessons/zero.py",
)
THEORY = lab07_layout.THEORY  # the predictions' theory, one home (tests/test_lab_design.py reads it here)
WHAT = "the library's hybrid code or the checks' reference"
MESH_CODE = "core/mesh.py"
LATER = tuple(entry for entry in LIBRARY if entry != MESH_CODE)  # parts 2 and 3

# Part 1: placements of 8 live ranks (torch's DeviceMesh builds their groups from your mesh), then more, checked in
# the grader against its exact search (lab07_layout.least_nodes). Each: (axes, GPUs per node, the launcher's
# numbering, payload per rank and step by axis). In the first five the sizes nest (the textbook rule, heaviest axis
# fastest, is the least); in the last five they do not, and it is not: a heavy group must straddle nodes, and which
# of its pieces share a node decides the next axis' count.
LIVE_PLACEMENTS = [
    ({"dp": 2, "pp": 2, "tp": 2}, 4, "cyclic", {"tp": 300, "dp": 200, "pp": 10}),
    ({"pp": 2, "dp": 2, "tp": 2}, 2, "block", {"dp": 300, "tp": 200, "pp": 10}),  # dp heaviest: dp on the pairs
    ({"tp": 2, "dp": 4}, 4, "cyclic", {"tp": 50, "dp": 90}),
]
MORE_PLACEMENTS = [
    ({"dp": 2, "pp": 3, "tp": 2}, 4, "block", {"tp": 300, "dp": 200, "pp": 10}),
    ({"dp": 2, "pp": 2, "tp": 3}, 6, "cyclic", {"tp": 300, "pp": 200, "dp": 10}),
    ({"dp": 2, "tp": 3}, 2, "block", {"tp": 300, "dp": 200}),  # heaviest fastest: (4, 6); the least (4, 5)
    ({"tp": 3, "dp": 2, "pp": 2}, 2, "cyclic", {"tp": 300, "dp": 200, "pp": 10}),  # (8, 12, 12); (8, 10, 12)
    ({"dp": 2, "pp": 3, "tp": 2}, 3, "cyclic", {"tp": 300, "dp": 200, "pp": 10}),  # (8, 10, 12); (8, 10, 10)
    ({"dp": 6, "tp": 2}, 4, "block", {"dp": 300, "tp": 200}),  # (4, 12); (4, 10)
    ({"tp": 3, "dp": 4}, 4, "cyclic", {"tp": 300, "dp": 200}),  # (6, 9); (6, 8)
]

# Part 3: the plans, (model, ranks, budget in bytes); the ones of 8 ranks also run on live ranks. With its head
# tied the model saves the head on one stage and pays the two copies' sum on two: at 440,000 bytes on 8 ranks the
# tied model fits tp 2 where the untied one needs dp 8; on 6 ranks at 590,000 only the tied one fits at all.
PLAN_CASES = [
    (TIED, 8, 480_000),
    (TIED, 8, 490_000),
    (TIED, 8, 600_000),
    (TIED, 8, 2_000_000),
    (TIED, 8, 440_000),
    (CFG, 8, 440_000),
    (TIED, 8, 400_000),
    (TIED, 12, 300_000),
    (CFG, 6, 590_000),
    (TIED, 6, 590_000),
]


STRUCTURAL = {
    "groups": "your placement of three meshes on 8 live ranks (2 nodes of 4 numbered cyclically, 4 pairs numbered "
    "node by node with dp heavier than tp, dp x tp with dp heavier) handed to torch's DeviceMesh as its mesh, and "
    "seven more of 6 to 12 ranks on nodes of 2, 3, 4 and 6, five of them with sizes that do not nest (a group of 3 "
    "on nodes of 2 or 4, of 6 on nodes of 4, of 2 on nodes of 3), where the heaviest axis varied fastest is not the "
    "least: the nodes each axis' groups span, heaviest axis first, against the least (the grader's exact search "
    "over every way to fill the nodes; a FAIL names the axis, the expected and received count and a group that "
    "spans too many); no call into parlab.core.mesh",
    "step": "your step on 8 live ranks for dp-pp-tp (2 stages, tp 2), tp-dp-pp (tp 4, slowest) and pp-tp-dp (4 stages, "
    "two of them in the middle): the loss and "
    "every rank's gradient slices against one device (float64), and x.grad on every rank under DDP's convention "
    "(a first-stage rank: its replica's rows hold the gradient of its replica's loss, the mean over its rows, "
    "D times the whole batch's there; 0 elsewhere and on later stages); every call it makes into torch.distributed, "
    "recorded at the process group with that group's ranks: each rank's all-reduce bytes on each group of ranks "
    "(tp, dp, each K/V head's holders, which your step works out and creates) and its sends and receives on pp "
    "equal the theory's (a FAIL names the first rank and group with expected and received), nothing else; no call "
    "into the library's hybrid code",
    "traffic": "the predicted bytes that leave node 0 in one step of dp-pp-tp with twice the step check's batch "
    "(B = 16), on 4 nodes of 2 GPUs numbered cyclically, with torch's row-major mesh and with the placement of "
    "part 1 for that step's payloads, against the grader's theory (1%) and against the bytes your step, run at "
    "that batch, handed to its groups (each all-reduce a ring in its group's order)",
    "plan": "your plan for ten (model, ranks, budget) of 6, 8 and 12 ranks, untied and tied (two where nothing "
    "fits, one where tying changes the plan, one decided by the memory tie-break): a layout the model and the batch "
    "allow, micro-batches dividing a replica's rows, your three numbers (the pipeline's bubble, the model-state "
    "bytes of the busiest rank, the bytes sent in a step by the rank that sends the most) against the theory for "
    "your plan, a bubble of at most 25%, the busiest rank within the budget, and no allowed plan whose busiest "
    "sender sends fewer bytes (then: whose busiest rank holds less), against the grader's enumeration; the plans "
    "for 8 ranks run on live ranks with the library's ZeRO over dp, the busiest rank's bytes counted against your "
    "held",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def plain(value) -> float | str:
    """A prediction as plain data for the grader: a float, or (what cannot be one) a short text."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def _shape(axes: dict[str, int]) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in axes.items())


def _where(rank: int, axes: dict[str, int]) -> str:
    """'rank 5 (dp 1, pp 0, tp 1)'."""
    return f"rank {rank} ({', '.join(f'{a} {i}' for a, i in mesh_coords(rank, axes).items())})"


def _shown(value) -> str:
    if isinstance(value, bool) or value is None:
        return "none" if value is None else str(value)
    if isinstance(value, (int, float)) and float(value).is_integer():
        return f"{int(value):,}"
    if isinstance(value, float):
        return f"{value:,.3f}"
    return str(value)


def _same(expected, received) -> bool:
    if isinstance(expected, (int, float)) and isinstance(received, (int, float)) and not isinstance(received, bool):
        return math.isclose(expected, received, rel_tol=1e-9, abs_tol=1e-6)
    return expected == received


def first_difference(what: str, items: list[tuple[str, object, object]]) -> str:
    """One verdict over many (label, expected, received): PASS when every one is as expected, else FAIL with the
    first that is not, what was expected and what came."""
    wrong = [(label, e, r) for label, e, r in items if not _same(e, r)]
    if not wrong:
        return f"{what}: all {len(items)} as expected: PASS"
    label, e, r = wrong[0]
    return (
        f"{what}: {len(wrong)} of {len(items)} differ; first {label}: expected {_shown(e)}, received {_shown(r)}: FAIL"
    )


def recording():
    """parlab.core.probe's recording, with the group of each call ("group": its sorted global ranks) and a
    send's or receive's partner as a global rank ("peer")."""
    return probe.recording(keep_sent_data=False, with_groups=True)


# ------------------------------------------------------------------------------- the layout (the one home)


def deal(cfg: LabConfig, axes: dict[str, int], rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The pieces of the full weights `rank` holds, copied onto this rank's device."""
    pieces = {}
    for name, where in layout(cfg, axes, rank).items():
        tensor = full[name] if where is None else full[name].narrow(where[0], where[1], where[2] - where[1])
        pieces[name] = tensor.detach().clone().to(parlab.device())
    return pieces


def lab_weights(cfg: LabConfig = CFG) -> dict[str, torch.Tensor]:
    """The lab model's full weights, seeded: the same on every rank."""
    model = build_lab_model(cfg, 0)  # host: the seeded model; each rank copies its pieces onto its device (deal)
    return {name: p.detach() for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------- part 1: groups


def _describe(case) -> str:
    axes, gpus, numbering, payload = case
    world = math.prod(axes.values())
    order = " > ".join(sorted(payload, key=lambda a: -payload[a]))
    return f"{_shape(axes)} on {world // gpus} nodes of {gpus}, {numbering} numbering, payload {order}"


def _as_mesh(value) -> list | str:
    """Your mesh as nested lists of ints, or a short text saying what came instead."""
    try:
        return torch.as_tensor(value, dtype=torch.long).tolist()  # host: rank numbers, no data
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(value).__name__}: {exc}"[:80]


def _mesh_problem(mesh, axes: dict[str, int]) -> str:
    """'' when `mesh` holds every rank of the world once in the shape of `axes`, else what is wrong."""
    if isinstance(mesh, str):
        return f"not a nested list of ranks ({mesh})"
    grid = torch.tensor(mesh)  # host: rank numbers, no data
    if list(grid.shape) != list(axes.values()):
        return f"shape {list(grid.shape)}, not {list(axes.values())}"
    world = math.prod(axes.values())
    if sorted(grid.flatten().tolist()) != list(range(world)):
        return f"ranks {sorted(grid.flatten().tolist())[:10]}..., not each of 0..{world - 1} once"
    return ""


def torch_mesh_groups(cases: list) -> list:
    """Rank code: for each (axes, mesh), torch's DeviceMesh built on that mesh and this rank's group on each axis
    (None where the mesh is not one: every rank skips it alike)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    out = []
    for axes, mesh in cases:
        if mesh is None:
            out.append(None)
            continue
        built = TorchMesh(device, torch.tensor(mesh), mesh_dim_names=tuple(axes))  # host: rank numbers
        out.append({axis: list(dist.get_process_group_ranks(built.get_group(axis))) for axis in axes})
    return out


def collect_groups(place) -> dict:
    with library_calls(LIBRARY) as called:
        meshes = [
            _as_mesh(place(dict(axes), gpus, numbering, dict(payload)))
            for axes, gpus, numbering, payload in LIVE_PLACEMENTS + MORE_PLACEMENTS
        ]
    live = [
        (case[0], None if _mesh_problem(mesh, case[0]) else mesh)
        for case, mesh in zip(LIVE_PLACEMENTS, meshes, strict=False)
    ]
    torch_says = list(parlab.launch(torch_mesh_groups, WORLD, live, **LAUNCH))
    return {"meshes": meshes, "torch": torch_says, "library": list(called)}


def placement_line(case, groups: dict[str, list[list[int]]]) -> str:
    """The verdict on one placement from its groups per axis: the nodes they span, heaviest axis first, against
    the least (lexicographically: the heaviest axis' first)."""
    axes, gpus, numbering, payload = case
    world = math.prod(axes.values())
    what = f"{_describe(case)}: nodes spanned by each axis' groups, heaviest axis first"
    fewest, _ = least_nodes(axes, gpus, payload)
    for axis, least in zip(sorted(axes, key=lambda a: -payload[a]), fewest, strict=True):
        got = spans(groups[axis], gpus, numbering)
        if got < least:
            break  # fewer than the grader's exact search (it cannot be): at least as good
        if got > least:
            wide = max(groups[axis], key=lambda g: len({node_of(r, world, gpus, numbering) for r in g}))
            nodes = sorted({node_of(r, world, gpus, numbering) for r in wide})
            return (
                f"{what}: the {axis} groups span {got} nodes in all, the least is {least}; e.g. ranks {wide} on "
                f"nodes {nodes}: FAIL"
            )
    return f"{what}: the least: PASS"


def judge_groups(data) -> list[str]:
    lines = []
    cases = LIVE_PLACEMENTS + MORE_PLACEMENTS
    for i, case in enumerate(cases):
        axes, mesh = case[0], data["meshes"][i]
        problem = _mesh_problem(mesh, axes)
        if problem:
            lines.append(f"{_describe(case)}: your mesh: {problem}: FAIL")
            continue
        if i < len(LIVE_PLACEMENTS):  # the groups torch built on 8 live ranks from your mesh
            built = [rank[i] for rank in data["torch"]]
            groups = {axis: sorted({tuple(rank[axis]) for rank in built}) for axis in axes}
            groups = {axis: [list(g) for g in found] for axis, found in groups.items()}
        else:
            groups = {axis: mesh_groups(mesh, axes, axis) for axis in axes}
        lines.append(placement_line(case, groups))
    lines.append(library_line("groups", data["library"], "parlab's mesh, " + WHAT))
    return lines


# ---------------------------------------------------------------------------------------- part 2: the step

BLOCK_KEYS = {  # a block's weights as the step receives them: short name -> the lab model's name in a block
    "attn_norm": "attn_norm.weight",
    "q": "attn.q.weight",
    "k": "attn.k.weight",
    "v": "attn.v.weight",
    "o": "attn.o.weight",
    "mlp_norm": "mlp_norm.weight",
    "gate": "mlp.gate.weight",
    "up": "mlp.up.weight",
    "down": "mlp.down.weight",
}


def f(x: torch.Tensor, tp_group) -> torch.Tensor:
    """Megatron's f over `tp_group`: identity forward, all-reduce of the gradient backward. x: [b, T, H]."""
    return copy_to_tensor_parallel(x, "f", tp_group)


def g(x: torch.Tensor, tp_group) -> torch.Tensor:
    """Megatron's g over `tp_group`: all-reduce forward (the sum of the ranks' partial products), identity
    backward. x: [b, T, H]."""
    return reduce_from_tensor_parallel(x, "g", tp_group)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean over the tokens of |out - target|^2: out, target [rows, T, H]."""
    return ((out - target) ** 2).sum(dim=-1).mean()


def full_batch(seed: int = 1, device=None, rows: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch x: [rows, T, H] (an embedding's output) and its target [rows, T, H], the same on every
    rank (rows: B = 8 in the step's check, 16 in the traffic check)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, CFG.seq_len, CFG.hidden)
    x, target = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))  # host: the seeded draw
    return x.to(device or "cpu"), target.to(device or "cpu")


def stage_blocks(axes: dict[str, int], rank: int, full: dict[str, torch.Tensor]) -> tuple[list[int], list[dict]]:
    """The blocks `rank` holds (its stage's), each as {short name: its piece} (leaves that require grad)."""
    pieces = deal(CFG, axes, rank, full)
    ids = sorted({int(name.split(".")[1]) for name in pieces if name.startswith("blocks.")})
    blocks = [{key: pieces[f"blocks.{i}.{name}"].requires_grad_() for key, name in BLOCK_KEYS.items()} for i in ids]
    return ids, blocks


def run_step(hybrid_step, layouts: list[dict[str, int]], rows: int = B) -> list[dict]:
    """Rank code: for each layout, build the mesh, deal out the blocks, run your step once on a global batch of
    `rows` rows, recording every call."""
    full, out = lab_weights(), []
    for axes in layouts:
        mesh = DeviceMesh(axes)
        ids, blocks = stage_blocks(axes, mesh.rank, full)
        x, target = full_batch(device=parlab.device(), rows=rows)
        x.requires_grad_()  # x stands for an embedding's output: its gradient is wanted too
        with recording() as calls, library_calls(LATER) as called:
            loss = hybrid_step(mesh, blocks, x, target)
        out.append(
            {
                "coords": dict(mesh.coords),
                "ids": ids,
                "loss": None
                if loss is None
                else torch.as_tensor(loss, dtype=torch.float64).detach().reshape(()),  # host: handed back
                "grads": [{key: w.grad for key, w in block.items()} for block in blocks],
                "xgrad": x.grad,
                "calls": calls,
                "library": list(called),
            }
        )
    return out


def single_device() -> dict:
    """One device: the whole batch through the lab model's 4 full blocks (parlab.core.lab_model.LabBlock)."""
    model = build_lab_model(CFG, 0)
    x, target = full_batch()
    x.requires_grad_()
    h = x
    positions = torch.arange(CFG.seq_len)  # host: the reference on one device
    for block in model.blocks:
        h = block(h, positions)
    loss = loss_fn(h, target)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "xgrad": x.grad}


def replica_xgrad(reference: torch.Tensor, axes: dict[str, int], rank: int) -> torch.Tensor:
    """What x.grad must be on `rank` under the handout's convention (DDP's: each replica's loss the mean over its
    own rows): on a first-stage rank, in its replica's rows, the gradient of that loss, D times the whole batch's
    there, and 0 in the other rows; 0 on the later stages' ranks (which do not read x). reference: [B, T, H]."""
    c, D = mesh_coords(rank, axes), axes["dp"]
    expected = torch.zeros_like(reference)
    if c["pp"] == 0:
        b = reference.shape[0] // D
        rows = slice(c["dp"] * b, (c["dp"] + 1) * b)
        expected[rows] = D * reference[rows]
    return expected


def per_group(result: dict, axes: dict[str, int], rank: int) -> dict:
    """A rank's calls: the all-reduce payload on each group of ranks ({sorted ranks: bytes}), (op, stage step,
    bytes) of its sends and receives on its pp group, and the other calls. A call on a group of one rank moves
    nothing and is left out."""
    got = {"allreduce": {}, "pp": [], "stray": []}
    pp_ranks = row_major_group(rank, axes, "pp")
    for call in result["calls"]:
        group = tuple(call["group"])
        if len(group) == 1:
            continue
        if call["op"] == "allreduce":
            got["allreduce"][group] = got["allreduce"].get(group, 0) + int(call["bytes"])
        elif call["op"] in probe.P2P and list(group) == sorted(pp_ranks) and call["peer"] in pp_ranks:
            got["pp"].append((call["op"], pp_ranks.index(call["peer"]) - pp_ranks.index(rank), int(call["bytes"])))
        else:
            got["stray"].append(f"{call['op']} of {int(call['bytes']):,} bytes on ranks {list(group)}")
    got["pp"] = sorted(got["pp"])
    return got


def _messages(pp: list) -> str:
    """[('send', 1, 4096), ...] as 'send to the next stage 4,096 bytes, ...' ('nothing' when empty)."""
    where = {1: "the next stage", -1: "the previous stage"}
    text = [
        f"{op} {'to' if op == 'send' else 'from'} {where.get(step, f'stage {step:+d}')} {b:,} bytes"
        for op, step, b in pp
    ]
    return ", ".join(text) or "nothing"


def gradient_line(what: str, items: list[tuple[str, object, torch.Tensor]], tol: float = 1e-10) -> str:
    """One verdict over many gradients (label, received, expected): compare's line when all match, else the first
    that does not, with its expected and received size."""
    worst, wrong = 0.0, []
    for label, got, expected in items:
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
            shape = "none" if not isinstance(got, torch.Tensor) else f"shape {list(got.shape)}"
            wrong.append(f"{label}: expected shape {list(expected.shape)}, received {shape}")
            continue
        err = (got.detach().cpu().to(torch.float64) - expected).abs().max().item() if expected.numel() else 0.0
        if not err <= tol:
            wrong.append(
                f"{label}: max |err| {err:.1e}, expected |g| {expected.norm():.3e}, received |g| {got.norm():.3e}"
            )
        else:
            worst = max(worst, err)
    if not wrong:
        return f"{what}: matches single device: max |err| {worst:.1e} <= tol {tol:.0e} (float64): PASS"
    return f"{what}: DIFFERS from single device: {len(wrong)} of {len(items)} tensors; first {wrong[0]}: FAIL"


def _group_name(axes: dict[str, int], rank: int, ranks: tuple[int, ...]) -> str:
    """'ranks [0, 2] (tp)', '(dp)', '(K/V head 1)' or '(not one of its groups)'."""
    names = [axis for axis in ("tp", "pp", "dp") if tuple(sorted(row_major_group(rank, axes, axis))) == ranks]
    tp = row_major_group(rank, axes, "tp")
    names += [
        f"K/V head {j}" for j, held in kv_holders(tp, CFG.heads, CFG.kv_heads).items() if tuple(sorted(held)) == ranks
    ]
    return f"ranks {list(ranks)} ({', '.join(names) or 'not one of its groups'})"


def collect_step(hybrid_step) -> dict:
    """One launch per mesh, so that a rank failing on one (a collective of mismatched sizes, a hang) still leaves
    the other's verdicts."""
    meshes = []
    for axes in STEP_MESHES:
        try:
            meshes.append(
                {"ranks": [rank[0] for rank in parlab.launch(run_step, WORLD, hybrid_step, [axes], **LAUNCH)]}
            )
        except Exception as exc:  # a rank's own error line (or the hang diagnosis), for this mesh's verdict
            meshes.append({"error": error_summary(exc)})
    return {"meshes": meshes}


def judge_step(data) -> list[str]:
    reference, lines, called = single_device(), [], []
    for axes, ran in zip(STEP_MESHES, data["meshes"], strict=True):
        shape = _shape(axes)
        if "error" in ran:
            lines.append(f"{shape}: your step did not complete: {ran['error']}: FAIL")
            continue
        results = ran["ranks"]
        last = [
            r for r, res in enumerate(results) if res["coords"]["pp"] == axes["pp"] - 1 and res["coords"]["tp"] == 0
        ]
        losses = [results[r]["loss"] for r in last]
        loss = None if None in losses else sum(losses) / len(losses)  # one per replica: their mean
        lines.append(compare(f"{shape}: loss, the mean over the replicas", loss, reference["loss"]).line)
        grads = []
        for r, res in enumerate(results):
            where = layout(CFG, axes, r)
            for block, held in zip(res["ids"], res["grads"], strict=True):
                for key, name in BLOCK_KEYS.items():
                    full_name = f"blocks.{block}.{name}"
                    expected, piece = reference["grads"][full_name], where[full_name]
                    if piece is not None:
                        expected = expected.narrow(piece[0], piece[1], piece[2] - piece[1])
                    grads.append((f"{_where(r, axes)} {full_name}", held[key], expected))
        lines.append(gradient_line(f"{shape}: every rank's gradient pieces", grads))
        xgrads = []
        for r, res in enumerate(results):
            expected = replica_xgrad(reference["xgrad"], axes, r)
            got = res["xgrad"]
            if got is None and mesh_coords(r, axes)["pp"] > 0:
                got = torch.zeros_like(expected)  # a later stage does not read x: None is as good as zeros
            xgrads.append((f"{_where(r, axes)} x.grad", got, expected))
        lines.append(gradient_line(f"{shape}: x.grad on every rank (its replica's loss, its rows)", xgrads))
        got = [per_group(res, axes, r) for r, res in enumerate(results)]
        theory = [step_theory(axes, r) for r in range(WORLD)]
        stray = [(f"{_where(r, axes)}", "none", ", ".join(g["stray"][:2])) for r, g in enumerate(got) if g["stray"]]
        what = f"{shape}: calls other than all-reduces and the pipeline's sends and receives on pp"
        lines.append(first_difference(what, stray) if stray else f"{what}: none: PASS")
        items = []
        for r, (mine, th) in enumerate(zip(got, theory, strict=True)):
            for ranks in sorted(set(th["allreduce"]) | set(mine["allreduce"])):
                label = f"{_where(r, axes)} on {_group_name(axes, r, ranks)}"
                items.append((label, th["allreduce"].get(ranks, 0), mine["allreduce"].get(ranks, 0)))
        what = f"{shape}: every rank's all-reduce bytes on each group of ranks against the theory"
        lines.append(first_difference(what, items))
        if axes["pp"] > 1:
            items = [
                (_where(r, axes), _messages(th["pp"]), _messages(g["pp"]))
                for r, (g, th) in enumerate(zip(got, theory, strict=True))
            ]
            lines.append(first_difference(f"{shape}: every rank's sends and receives on pp against the theory", items))
        called += [name for res in results for name in res["library"]]
    lines.append(library_line("step", called, WHAT))
    return lines


# ------------------------------------------------------------------------------------ traffic prediction

PREDICTED = ("naive_bytes", "placed_bytes")
_TRAFFIC = f"dp=2 x pp=2 x tp=2, B = {TRAFFIC_BATCH}, on 4 nodes of 2, cyclic numbering"
LABELS = {
    "naive_bytes": f"{_TRAFFIC}, torch's row-major mesh: bytes leaving node 0 in one step",
    "placed_bytes": f"{_TRAFFIC}, part 1's placement: bytes leaving node 0 in one step",
}


def measured_calls(result: dict, axes: dict[str, int], rank: int) -> dict:
    """What a rank's recorded step handed over, in crossing_bytes' form: all-reduce payload per group of ranks,
    and each send with its global peer."""
    got = per_group(result, axes, rank)
    sends = [[int(c["peer"]), int(c["bytes"])] for c in result["calls"] if c["op"] == "send" and len(c["group"]) > 1]
    return {"allreduce": [[list(ranks), n] for ranks, n in got["allreduce"].items()], "sends": sends}


def collect_traffic(predicted: dict, hybrid_step) -> dict:
    ranks = parlab.launch(run_step, WORLD, hybrid_step, [TRAFFIC_MESH], TRAFFIC_BATCH, **LAUNCH)
    calls = [measured_calls(rank[0], TRAFFIC_MESH, r) for r, rank in enumerate(ranks)]
    return {"predicted": {k: plain(predicted.get(k)) for k in PREDICTED}, "calls": calls}


def judge_traffic(data) -> list[str]:
    theory, nodes, lines = traffic_theory(), traffic_nodes(), []
    calls = [
        {"allreduce": {tuple(ranks): n for ranks, n in mine["allreduce"]}, "sends": mine["sends"]}
        for mine in data["calls"]
    ]
    measured = {key: crossing_bytes(calls, nodes[key.split("_")[0]]) for key in PREDICTED}
    for key in PREDICTED:
        lines += prediction_lines(LABELS[key], data["predicted"][key], theory[key], measured[key], rtol=0.01)
    return lines


# ------------------------------------------------------------------------------------------- part 3: plan


def held_module(pieces: dict[str, torch.Tensor]) -> nn.Module:
    """The pieces as parameters of modules named as in the lab model (embed, blocks.2, ..., norm, head): ZeRO's
    units are the top-level children."""
    root = nn.Module()
    for name, tensor in pieces.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(tensor))
    return root


def measure_states(plans: list) -> list:
    """Rank code: for each (model, layout, ZeRO stage) (None: skipped alike on every rank), the pieces this rank
    holds and the bytes of its parameters, gradients and optimizer states (Adam: master, m, v) counted from the
    tensors it holds: the library's ZeRO over the dp group on the pieces, or, with no ZeRO, the pieces, their
    gradients and three optimizer tensors each."""
    out = []
    for plan in plans:
        if plan is None:
            out.append(None)
            continue
        cfg, axes, zero = plan
        mesh = DeviceMesh(axes)
        pieces = deal(cfg, axes, mesh.rank, lab_weights(cfg))
        if zero and axes["dp"] > 1:
            sharded = ZeRO(held_module(pieces), zero, lr=0.01, group=mesh.group("dp"))
            held = sharded.held()
            sharded.remove()
            states = {kind: held[kind] for kind in KINDS}
        else:
            numbers = sum(t.numel() * t.element_size() for t in pieces.values())
            states = {"params": numbers, "grads": numbers, "optimizer": 3 * numbers}
        out.append({"shapes": {n: list(t.shape) for n, t in pieces.items()}, "states": states})
    return out


def _as_states(value) -> dict | str:
    try:
        return {kind: float(value[kind]) for kind in KINDS}
    except (TypeError, KeyError, ValueError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"[:80]


PLAN_KEYS = ("axes", "zero", "microbatches", "held", "sent", "bubble")


def _as_plan(value, world: int):
    """Your plan as {"axes": {"dp", "pp", "tp"}, "zero", "microbatches", "held", "sent", "bubble"} of plain
    numbers, None, or a short text saying what came instead."""
    if value is None:
        return None
    try:
        value = dict(value)
        missing = [key for key in PLAN_KEYS if key not in value]
        if missing:
            return f"a dict without {', '.join(missing)}"
        axes = dict(value["axes"])
        if set(axes) - {"dp", "pp", "tp"}:
            return f"axes {sorted(axes)}, not dp, pp, tp"
        sizes = {axis: int(axes.get(axis, 1)) for axis in ("dp", "pp", "tp")}
        if math.prod(sizes.values()) != world:
            return f"{sizes} is not a mesh of {world} ranks"
        return {
            "axes": sizes,
            "zero": int(value["zero"]),
            "microbatches": int(value["microbatches"]),
            **{key: float(value[key]) for key in ("held", "sent", "bubble")},
        }
    except (TypeError, ValueError, AttributeError) as exc:
        return f"{type(value).__name__}: {exc}"[:80]


def _plan_text(plan) -> str:
    if plan is None:
        return "none fits"
    if isinstance(plan, str):
        return plan
    return f"{_shape(plan['axes'])}, ZeRO {plan['zero']}, {plan['microbatches']} micro-batches"


def _model(cfg: LabConfig) -> str:
    return "tied" if cfg.tied else "untied"


def collect_plan(plan) -> dict:
    with library_calls(LATER) as called:
        choices = [_as_plan(plan(cfg, world, budget), world) for cfg, world, budget in PLAN_CASES]
    runs = [
        (cfg, dict(got["axes"]), got["zero"])
        if world == WORLD and isinstance(got, dict) and _allowed(cfg, got)
        else None
        for (cfg, world, _), got in zip(PLAN_CASES, choices, strict=True)
    ]
    measured = list(parlab.launch(measure_states, WORLD, runs, **LAUNCH))
    return {"choices": choices, "measured": measured, "library": list(called)}


def _allowed(cfg: LabConfig, plan: dict) -> bool:
    """The layout divides the model and the batch, the micro-batches divide a replica's rows, a ZeRO stage is one
    there is (none without dp)."""
    axes, zero, m = plan["axes"], plan["zero"], plan["microbatches"]
    world = math.prod(axes.values())
    if axes not in layouts_of(world, cfg) or zero not in ZERO_STAGES or (zero and axes["dp"] == 1):
        return False
    return m >= 1 and (B // axes["dp"]) % m == 0


def plan_line(cfg: LabConfig, world: int, budget: float, got) -> str:
    """The verdict on one plan: well formed, your numbers against the theory for it, its bubble, the budget, and
    no allowed plan sending fewer bytes from its busiest rank (then holding less)."""
    what = f"plan, {_model(cfg)}, {world} ranks, {budget:,} bytes a rank"
    best = best_plan(world, budget, cfg)
    if best is None or got is None:
        if best is None and got is None:
            return f"{what}: no plan fits, none given: PASS"
        if got is None:
            least = busiest(cfg, *best)
            sends = f"its busiest rank sending {_shown(least[0])} bytes"
            return f"{what}: expected a plan (one fits, {sends}), received none: FAIL"
    if isinstance(got, str):
        return f"{what}: expected a plan dict or None, received {got}: FAIL"
    if not _allowed(cfg, got):
        return (
            f"{what}: {_plan_text(got)} is not a plan of this model (tp dividing the heads, F and V; pp the blocks; dp "
            "the batch; the micro-batches a replica's rows; a ZeRO stage 0 to 3, 0 without dp): FAIL"
        )
    axes, zero, m = got["axes"], got["zero"], got["microbatches"]
    sent, held = busiest(cfg, axes, zero)
    idle = pipeline_bubble(axes["pp"], m)
    items = [("bubble", idle, got["bubble"]), ("held by the busiest rank", held, got["held"])]
    items.append(("sent by the busiest rank", sent, got["sent"]))
    numbers = first_difference(f"{what}: your numbers for {_plan_text(got)}", items)
    if numbers.endswith("FAIL"):
        return numbers
    if idle > MAX_BUBBLE:
        return f"{what}: {_plan_text(got)} idles {idle:.1%} of the step, more than {MAX_BUBBLE:.0%}: FAIL"
    if held > budget:
        return f"{what}: {_plan_text(got)}: its busiest rank holds {_shown(held)} bytes, over the budget: FAIL"
    if best is None:
        return f"{what}: expected none (nothing fits), received {_plan_text(got)}: FAIL"
    least = busiest(cfg, *best)
    if (round(sent, 6), held) != (round(least[0], 6), least[1]):
        return (
            f"{what}: {_plan_text(got)} fits; its busiest rank sends {_shown(sent)} bytes and holds {_shown(held)}; "
            f"expected a plan sending {_shown(least[0])} (then holding {_shown(least[1])}): FAIL"
        )
    # The same line for every right plan (the grader compares PASS lines with the solution's): plans that tie, and
    # every number of micro-batches within the bubble's bound, are equally right.
    return f"{what}: your numbers right, it fits, idles at most {MAX_BUBBLE:.0%}, sends the fewest: PASS"


def judge_plan(data) -> list[str]:
    lines = [
        plan_line(cfg, world, budget, got)
        for (cfg, world, budget), got in zip(PLAN_CASES, data["choices"], strict=True)
    ]
    for i, ((cfg, world, budget), got) in enumerate(zip(PLAN_CASES, data["choices"], strict=True)):
        if world != WORLD or not isinstance(got, dict):
            continue
        what = f"your plan, {_model(cfg)}, {budget:,} bytes a rank, on 8 live ranks (the library's ZeRO over dp)"
        if data["measured"][0][i] is None:
            lines.append(f"{what}: {_plan_text(got)} cannot run: FAIL")
            continue
        heaviest = max(sum(data["measured"][r][i]["states"].values()) for r in range(WORLD))
        items = [("the busiest rank's model states, bytes", heaviest, got["held"])]
        line = first_difference(f"{what}: counted on the ranks against your held", items)
        if line.endswith(": PASS") and heaviest > budget:
            line = f"{what}: the busiest rank holds {heaviest:,} bytes, over the budget: FAIL"
        lines.append(line)
    lines.append(library_line("plan", data["library"], WHAT))
    return lines
