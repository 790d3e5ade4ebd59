"""Lab 07's checks: the groups of a device mesh (and of the ranks that share a K/V head), what each rank of a
dp x pp x tp mesh holds of the lab model with ZeRO-1, and one hybrid training step of the lab model's blocks with
each collective on its axis (see parlab/grading for collect_/judge_).

The model is the labs' own (parlab/core/lab_model.py): RMSNorm, grouped-query attention with fewer K/V heads than
query heads, RoPE, a SwiGLU MLP without biases, an untied head. Its layout on the mesh (which rank holds which
piece), and every count made from it, are in parlab/grading/labs/lab07_layout.py, the reference: the answer of
parts 1 and 2, on the lab's LIBRARY. Every call the step makes into torch.distributed is recorded at the process
group, with the global ranks of that group (`recording`), so the checks see which group each call used; calls into
the library's own hybrid code (and into the reference) are seen too (`LIBRARY`, parlab/grading/labs/guard.py).
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
from parlab.grading.labs import lab07_layout, prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab07_layout import (
    CFG,
    KINDS,
    STEP_MESHES,
    B,
    _rank0,
    held_shapes,
    held_states,
    kv_ranks,
    layout,
    layouts_of,
    memory_at_scale_theory,
    own_groups,
    row_major_group,
    step_theory,
    traffic_theory,
)
from parlab.schemes.tensor_parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel
from parlab.schemes.zero.stages import ZeRO

LAUNCH = {"timeout": 30, "echo": False}  # a hang (a call some rank never matches) is diagnosed after 30 s
WORLD = 8

# What the parts must not call: the library's mesh arithmetic (part 1 only: later parts may use parlab's mesh, it is
# what part 1 built), its hybrid scheme and the pieces it composes, the lesson helpers around them, and this lab's
# own reference (the answers of parts 1 and 2).
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


# Part 1: meshes of 8 live ranks (torch's DeviceMesh builds their groups), then larger ones checked in the grader.
LIVE_MESHES = [
    {"dp": 2, "pp": 2, "tp": 2},
    {"pp": 2, "dp": 2, "tp": 2},  # Megatron-LM's order: pp slowest
    {"tp": 2, "dp": 4},  # tp slowest: tp partners far apart
]
LARGE_MESHES = [
    {"dp": 3, "pp": 2, "tp": 4},
    {"pp": 3, "tp": 2, "dp": 2},
    {"tp": 3, "pp": 2, "dp": 2},
    {"dp": 2, "pp": 1, "tp": 3},
]
KV_CASES = [  # (mesh, query heads, K/V heads): who shares this rank's K/V heads
    ({"dp": 2, "pp": 2, "tp": 2}, 8, 2),  # one K/V head per rank: nobody
    ({"tp": 4, "dp": 2, "pp": 1}, 8, 2),  # two ranks per K/V head, tp slowest: partners 2 apart
    ({"pp": 2, "dp": 1, "tp": 4}, 8, 1),  # one K/V head (multi-query): the whole tp group
    ({"dp": 2, "tp": 8}, 16, 4),
    ({"tp": 2, "pp": 3, "dp": 2}, 4, 4),  # two K/V heads per rank: nobody
    ({"pp": 2, "tp": 8, "dp": 1}, 8, 2),
]


MORE_MESHES = [  # part 2 in the grader, beside every other layout of 8 ranks
    {"pp": 2, "dp": 2, "tp": 4},
    {"dp": 2, "pp": 1, "tp": 8},
    {"tp": 2, "pp": 4, "dp": 2},
]


STRUCTURAL = {
    "groups": "on 8 live ranks, torch's DeviceMesh (init_device_mesh) builds the groups of three layouts (axis "
    "orders dp-pp-tp, pp-dp-tp and tp-dp); your mesh_group, called on each rank, must name the same ranks, in axis "
    "order, for every rank and axis; four larger layouts (12 to 24 ranks, an axis of size 1) against torch's "
    "row-major layout; kv_group for six (mesh, heads, K/V heads): fewer, as many and more tp ranks than K/V heads, "
    "tp slowest; a FAIL names the first rank, axis, expected and received group; no call into parlab.core.mesh",
    "memory": "two ZeRO-1 runs on 8 live ranks (the library's ZeRO over dp on the pieces the layout deals out): "
    "every rank's tensors and their shapes, and its params, grads and optimizer bytes counted from its tensors, "
    "against yours; then every other layout of 8 ranks and three of 16 against the theory; a FAIL names the first "
    "rank and tensor (or kind) with expected and received bytes",
    "step": "your step on 8 live ranks for dp-pp-tp (2 stages) and tp-dp-pp (tp = 4 > 2 K/V heads): the loss and "
    "every rank's gradient slices against one device (float64); every call it makes into torch.distributed, "
    "recorded at the process group with that group's ranks, on one of the rank's own groups (tp, pp, dp, or the "
    "ranks sharing its K/V head), with exactly the theory's bytes on each; no call into the library's hybrid code",
    "traffic": "the predicted payload bytes of rank 0 on tp, pp and dp (dp-pp-tp) and on its K/V group (tp-dp-pp), "
    "against the grader's theory and against the bytes your step handed to each group on rank 0",
    "memory_at_scale": "the predicted model-state GB of the busiest GPU of a Llama-like GQA model against the "
    "grader's count of what each rank holds (the same layout as part 2), 5%",
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
    return str(value)


def first_difference(what: str, items: list[tuple[str, object, object]]) -> str:
    """One verdict over many (label, expected, received): PASS when every one is as expected, else FAIL with the
    first that is not, what was expected and what came."""
    wrong = [(label, e, r) for label, e, r in items if e != r]
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


def lab_weights() -> dict[str, torch.Tensor]:
    """The lab model's full weights, seeded: the same on every rank."""
    # host: the seeded model; each rank copies its pieces onto its device (deal)
    return {name: p.detach() for name, p in build_lab_model(CFG, 0).named_parameters()}


# ----------------------------------------------------------------------------------------- part 1: groups


def _ranks(value) -> list[int] | str:
    try:
        return [int(r) for r in value]
    except (TypeError, ValueError):
        return f"{type(value).__name__}: {value!r}"[:60]


def torch_groups(mesh_group, layouts: list[dict[str, int]]) -> dict:
    """Rank code: for each layout, torch's DeviceMesh groups of this rank and what mesh_group says."""
    rank, out = dist.get_rank(), []
    called: list[str] = []
    for axes in layouts:
        mesh = DeviceMesh(axes)  # torch's init_device_mesh: one process group per axis
        torch_says = {axis: sorted(dist.get_process_group_ranks(mesh.group(axis))) for axis in axes}
        with library_calls(LIBRARY) as seen:
            yours = {axis: _ranks(mesh_group(rank, dict(axes), axis)) for axis in axes}
        called += seen
        out.append({"torch": torch_says, "yours": yours})
    return {"layouts": out, "library": called}


def collect_groups(mesh_group, kv_group) -> dict:
    live = list(parlab.launch(torch_groups, WORLD, mesh_group, LIVE_MESHES, **LAUNCH))
    with library_calls(LIBRARY) as called:
        large = [
            [
                {axis: _ranks(mesh_group(rank, dict(axes), axis)) for axis in axes}
                for rank in range(math.prod(axes.values()))
            ]
            for axes in LARGE_MESHES
        ]
        kv = [
            [_ranks(kv_group(rank, dict(axes), heads, kv_heads)) for rank in range(math.prod(axes.values()))]
            for axes, heads, kv_heads in KV_CASES
        ]
    return {
        "live": [rank["layouts"] for rank in live],
        "large": large,
        "kv": kv,
        "library": [name for rank in live for name in rank["library"]] + list(called),
    }


def judge_groups(data) -> list[str]:
    lines = []
    for i, axes in enumerate(LIVE_MESHES):
        items = [
            (f"rank {r}, axis {axis}", data["live"][r][i]["torch"][axis], data["live"][r][i]["yours"][axis])
            for r in range(WORLD)
            for axis in axes
        ]
        lines.append(
            first_difference(f"{_shape(axes)} on 8 ranks: every rank's group on each axis against torch's", items)
        )
    for i, axes in enumerate(LARGE_MESHES):
        items = [
            (f"rank {r}, axis {axis}", row_major_group(r, axes, axis), data["large"][i][r][axis])
            for r in range(math.prod(axes.values()))
            for axis in axes
        ]
        lines.append(first_difference(f"{_shape(axes)}: every rank's group on each axis, row-major", items))
    for i, (axes, heads, kv_heads) in enumerate(KV_CASES):
        items = [
            (f"rank {r}", kv_ranks(r, axes, heads, kv_heads), data["kv"][i][r]) for r in range(math.prod(axes.values()))
        ]
        what = f"kv_group, {_shape(axes)}, {heads} query heads, {kv_heads} K/V: every rank's K/V group"
        lines.append(first_difference(what, items))
    lines.append(library_line("groups", data["library"], "parlab's mesh, " + WHAT))
    return lines


# ------------------------------------------------------------------------------------------ part 2: memory


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


def measure_states(layouts: list[dict[str, int]]) -> list[dict]:
    """Rank code: for each layout, the pieces this rank holds, and one ZeRO-1 step (the library's, Adam, over the
    dp group) on them: the shapes, and the bytes of parameters, gradients and optimizer states counted from the
    tensors it holds afterwards."""
    full, out = lab_weights(), []
    for axes in layouts:
        mesh = DeviceMesh(axes)
        pieces = deal(CFG, axes, mesh.rank, full)
        zero = ZeRO(held_module(pieces), 1, lr=0.01, group=mesh.group("dp"))
        for unit in zero.units:
            unit.grad_flat.fill_(1.0)  # a gradient: the step reduce-scatters it, steps Adam and gathers
        zero.step()
        held = zero.held()
        zero.remove()
        out.append({"shapes": {n: list(t.shape) for n, t in pieces.items()}, "states": {k: held[k] for k in KINDS}})
    return out


def _as_shapes(value) -> dict | str:
    try:
        return {str(name): [int(n) for n in shape] for name, shape in dict(value).items()}
    except (TypeError, ValueError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"[:80]


def _as_states(value) -> dict | str:
    try:
        return {kind: float(value[kind]) for kind in KINDS}
    except (TypeError, KeyError, ValueError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"[:80]


def collect_memory(local_shapes, state_bytes) -> dict:
    measured = [list(rank) for rank in parlab.launch(measure_states, WORLD, STEP_MESHES, **LAUNCH)]
    yours, layouts = {}, STEP_MESHES + other_layouts()
    with library_calls(LATER) as called:
        for axes in layouts:
            world = math.prod(axes.values())
            yours[_shape(axes)] = [
                {
                    "shapes": _as_shapes(local_shapes(CFG, dict(axes), r)),
                    "states": _as_states(state_bytes(CFG, dict(axes), r)),
                }
                for r in range(world)
            ]
    return {"measured": measured, "yours": yours, "library": list(called)}


def other_layouts() -> list[dict[str, int]]:
    """The layouts part 2 checks against the theory only: every other one of 8 ranks, and three of 16."""
    return [axes for axes in layouts_of(WORLD) if axes not in STEP_MESHES] + MORE_MESHES


def _shape_items(rank_label: str, expected: dict, received) -> list[tuple[str, object, object]]:
    """(label, expected, received) per tensor: its shape and bytes, 'none' when not held."""
    if isinstance(received, str):
        return [(rank_label, "a dict {name: shape}", received)]

    def shown(shape):
        return None if shape is None else f"{shape} ({math.prod(shape) * CFG.dtype_bytes:,} bytes)"

    names = list(expected) + sorted(set(received) - set(expected))
    return [(f"{rank_label}, {name}", shown(expected.get(name)), shown(received.get(name))) for name in names]


def _state_items(rank_label: str, expected: dict, received) -> list[tuple[str, object, object]]:
    if isinstance(received, str):
        return [(rank_label, "a dict with params, grads, optimizer", received)]
    return [(f"{rank_label}, {kind} bytes", expected[kind], received[kind]) for kind in KINDS]


def judge_memory(data) -> list[str]:
    lines = []
    for i, axes in enumerate(STEP_MESHES):
        yours = data["yours"][_shape(axes)]
        shapes, states = [], []
        for r, y in enumerate(yours):
            held = data["measured"][r][i]
            shapes += _shape_items(_where(r, axes), held["shapes"], y["shapes"])
            states += _state_items(_where(r, axes), held["states"], y["states"])
        what = f"{_shape(axes)}: every rank's tensors and their shapes against what the ranks held"
        lines.append(first_difference(what, shapes))
        what = f"{_shape(axes)}: every rank's params, grads and optimizer bytes against ZeRO-1's (measured)"
        lines.append(first_difference(what, states))
    items = []
    for axes in other_layouts():
        for r, y in enumerate(data["yours"][_shape(axes)]):
            label = f"{_shape(axes)} {_where(r, axes)}"
            items += _shape_items(label, held_shapes(CFG, axes, r), y["shapes"])
            items += _state_items(label, held_states(CFG, axes, r), y["states"])
    what = "every other layout of 8 ranks and three of 16: every rank's shapes and bytes against the theory"
    lines.append(first_difference(what, items))
    lines.append(library_line("memory", data["library"], WHAT))
    return lines


# ---------------------------------------------------------------------------------------- part 3: the step

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


def full_batch(seed: int = 1, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch x: [B, T, H] (an embedding's output) and its target [B, T, H], the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shape = (B, CFG.seq_len, CFG.hidden)
    x, target = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))  # host: the seeded draw
    return x.to(device or "cpu"), target.to(device or "cpu")


def stage_blocks(axes: dict[str, int], rank: int, full: dict[str, torch.Tensor]) -> tuple[list[int], list[dict]]:
    """The blocks `rank` holds (its stage's), each as {short name: its piece} (leaves that require grad)."""
    pieces = deal(CFG, axes, rank, full)
    ids = sorted({int(name.split(".")[1]) for name in pieces if name.startswith("blocks.")})
    blocks = [{key: pieces[f"blocks.{i}.{name}"].requires_grad_() for key, name in BLOCK_KEYS.items()} for i in ids]
    return ids, blocks


def run_step(hybrid_step, layouts: list[dict[str, int]]) -> list[dict]:
    """Rank code: for each layout, build the mesh, deal out the blocks, run your step once, recording every call."""
    full, out = lab_weights(), []
    for axes in layouts:
        mesh = DeviceMesh(axes)
        ids, blocks = stage_blocks(axes, mesh.rank, full)
        x, target = full_batch(device=parlab.device())
        x.requires_grad_()  # x stands for an embedding's output: its gradient is wanted too
        with recording() as calls, library_calls(LATER) as called:
            loss = hybrid_step(mesh, blocks, x, target)
        out.append(
            {
                "coords": dict(mesh.coords),
                "ids": ids,
                "loss": None if loss is None else torch.as_tensor(loss, dtype=torch.float64).detach().reshape(()),
                "grads": [{key: w.grad for key, w in block.items()} for block in blocks],
                "calls": calls,
                "library": list(called),
            }
        )
    return out


def single_device() -> dict:
    """One device: the whole batch through the lab model's 4 full blocks (parlab.core.lab_model.LabBlock)."""
    model = build_lab_model(CFG, 0)
    x, target = full_batch()
    h = x
    positions = torch.arange(CFG.seq_len)  # host: the reference on one device
    for block in model.blocks:
        h = block(h, positions)
    loss = loss_fn(h, target)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def per_group(result: dict, axes: dict[str, int], rank: int) -> dict:
    """A rank's calls by group: all-reduce bytes on tp, dp and its K/V group, (op, stage step, bytes) of its pp
    messages, and the calls on no group of its own (or of a kind its group does not carry). A call on a group of
    one rank moves nothing and is left out."""
    groups = own_groups(axes, rank)
    got = {"tp": 0, "dp": 0, "kv": 0, "pp": [], "stray": []}
    pp_ranks = row_major_group(rank, axes, "pp")
    for call in result["calls"]:
        if len(call["group"]) == 1:
            continue
        axis = next((axis for axis, ranks in groups.items() if call["group"] == ranks and len(ranks) > 1), None)
        if axis in ("tp", "dp", "kv") and call["op"] == "allreduce":
            got[axis] += int(call["bytes"])
        elif axis == "pp" and call["op"] in probe.P2P and call["peer"] in pp_ranks:
            got["pp"].append((call["op"], pp_ranks.index(call["peer"]) - pp_ranks.index(rank), int(call["bytes"])))
        else:
            got["stray"].append(f"{call['op']} of {int(call['bytes']):,} bytes on ranks {call['group']}")
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


def collect_step(hybrid_step) -> dict:
    return {"ranks": list(parlab.launch(run_step, WORLD, hybrid_step, STEP_MESHES, **LAUNCH))}


def judge_step(data) -> list[str]:
    reference, lines, called = single_device(), [], []
    for i, axes in enumerate(STEP_MESHES):
        results = [rank[i] for rank in data["ranks"]]
        shape = _shape(axes)
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
        got = [per_group(res, axes, r) for r, res in enumerate(results)]
        theory = [step_theory(axes, r) for r in range(WORLD)]
        stray = [(f"{_where(r, axes)}", "none", ", ".join(g["stray"][:2])) for r, g in enumerate(got) if g["stray"]]
        what = f"{shape}: calls on a group that is not one of the rank's own (tp, pp, dp, its K/V group)"
        lines.append(first_difference(what, stray) if stray else f"{what}: none: PASS")
        checked = [("tp", "tp all-reduce bytes"), ("pp", "sends and receives on pp"), ("dp", "dp all-reduce bytes")]
        checked = [(axis, label) for axis, label in checked if axes[axis] > 1]  # a group of one rank moves nothing
        if any(th["kv"] for th in theory):
            checked.append(("kv", "all-reduce bytes on the ranks sharing its K/V head"))
        for axis, label in checked:
            items = [
                (
                    _where(r, axes),
                    _messages(th["pp"]) if axis == "pp" else th[axis],
                    _messages(g["pp"]) if axis == "pp" else g[axis],
                )
                for r, (g, th) in enumerate(zip(got, theory, strict=True))
            ]
            lines.append(first_difference(f"{shape}: every rank's {label} against the theory", items))
        called += [name for res in results for name in res["library"]]
    lines.append(library_line("step", called, WHAT))
    return lines


# ------------------------------------------------------------------------------------ traffic prediction

PREDICTED = ("tp_bytes", "pp_bytes", "dp_bytes", "kv_bytes")
LABELS = {
    "tp_bytes": "rank 0 of dp=2 x pp=2 x tp=2: bytes all-reduced on tp in one step",
    "pp_bytes": "rank 0 of dp=2 x pp=2 x tp=2: bytes sent on pp in one step",
    "dp_bytes": "rank 0 of dp=2 x pp=2 x tp=2: bytes all-reduced on dp in one step",
    "kv_bytes": "rank 0 of tp=4 x dp=2 x pp=1: bytes all-reduced on its K/V group in one step",
}


def collect_traffic(predicted: dict, hybrid_step) -> dict:
    rank0 = parlab.launch(run_step, WORLD, hybrid_step, STEP_MESHES, **LAUNCH)[0]
    measured = _rank0([per_group(result, axes, 0) for result, axes in zip(rank0, STEP_MESHES, strict=True)])
    return {"predicted": {k: plain(predicted.get(k)) for k in PREDICTED}, "measured": measured}


def judge_traffic(data) -> list[str]:
    theory, lines = traffic_theory(), []
    for key in PREDICTED:
        lines += prediction_lines(LABELS[key], data["predicted"][key], theory[key], data["measured"][key])
    return lines


# ---------------------------------------------------------------------------------- the prediction at scale


def collect_memory_at_scale(predicted) -> dict:
    return {"predicted": plain(predicted)}


def judge_memory_at_scale(data) -> list[str]:
    label = "Llama-like 70B (GQA), TP 8 x PP 8 x DP 16 + ZeRO-1: GB of model states on the busiest GPU"
    return prediction_lines(label, data["predicted"], memory_at_scale_theory()["gb"])
