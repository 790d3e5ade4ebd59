"""Lab 07's checks: the groups of a device mesh, one hybrid training step with each collective on its axis, and
the memory of a layout with ZeRO-1 on the dp axis (see parlab/grading for collect_/judge_).

The hybrid step runs on a toy model: L Megatron MLP blocks, h <- h + g(relu(f(h) W1^T) W2^T) with W1: [F, H]
split by rows over tp (column-parallel), W2: [H, F] split by columns (row-parallel), float64; the loss is the mean
over a replica's rows of |h - target|^2. Every call the step makes into torch.distributed is recorded at the
process group, with the global ranks of that group (`recording`), so the checks see which axis each call used.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.check import check_equal, compare
from parlab.core.mesh import DeviceMesh, mesh_coords
from parlab.core.models import GPTConfig, build_model, make_batches
from parlab.grading.labs import prediction_lines, run_check
from parlab.schemes.hybrid.planner import Cluster, ModelSpec, Plan, estimate
from parlab.schemes.hybrid.train import train_hybrid
from parlab.schemes.pipeline.schedules import make_schedule
from parlab.schemes.tensor_parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a call some rank never matches) stops after 60 s
WORLD = 8

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

# Part 2: the toy model and the layouts the step runs on (one launch, two meshes in turn).
B, H, F, L = 12, 8, 32, 4  # global batch [B, H]; W1: [F, H], W2: [H, F]; L blocks
STEP_MESHES = [
    {"dp": 2, "pp": 2, "tp": 2},
    {"pp": 4, "dp": 2, "tp": 1},  # pp slowest, and middle stages that both receive and send
]
TRAFFIC_MESH = STEP_MESHES[0]  # the predicted run: rank 0 of this mesh

# Part 3: the reference GPT (float64) trained with ZeRO-1 and Adam on two layouts; every 8-rank layout estimated.
CFG = GPTConfig(layers=4)
MEASURED_MESHES = [{"dp": 2, "pp": 2, "tp": 2}, {"pp": 2, "dp": 4, "tp": 1}]
KINDS = ("params", "grads", "optimizer")
PLANNER_RTOL = 1e-3  # the planner counts no ZeRO padding (there is none at these sizes)

# The prediction at scale: GPT-3 175B on 1024 GPUs, Megatron-LM's TP 8 x PP 8, ZeRO-1 over DP 16, mixed precision.
GPT3 = ModelSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, tied=True)
GPT3_PLAN = Plan(dp=16, tp=8, pp=8, zero=1)
GPT3_BATCH = 1536

STRUCTURAL = {
    "groups": "on 8 live ranks, torch's DeviceMesh (init_device_mesh) builds the groups of three layouts (axis "
    "orders dp-pp-tp, pp-dp-tp and tp-dp); your function, called on each rank, must name the same ranks, in axis "
    "order, for every rank and axis; four larger layouts (12 to 24 ranks, an axis of size 1) against torch's "
    "row-major layout",
    "step": "your step on 8 live ranks for two meshes (dp-pp-tp with 2 stages; pp-dp-tp with 4): the loss and "
    "every rank's gradient slices against one device (float64); every call it makes into torch.distributed, "
    "recorded at the process group with that group's ranks, must be on one of the rank's own axis groups, with "
    "exactly the theory's bytes: all-reduces on tp, sends and receives with its pipeline neighbours on pp, the "
    "gradient all-reduce on dp",
    "traffic": "the predicted payload bytes of rank 0 on each axis in one step, against the grader's theory and "
    "against the bytes your step handed to each axis' group on rank 0 (recorded at the process group)",
    "memory": "every rank's parameter, gradient and optimizer-state bytes against what the ranks hold in two live "
    "ZeRO-1 hybrid runs (parlab.schemes.hybrid.train.train_hybrid, counted from the tensors; axis orders dp-pp-tp "
    "and pp-dp-tp); the busiest rank of every 8-rank layout against parlab's planner",
    "memory_at_scale": "the predicted model-state bytes of the busiest GPU against parlab's planner",
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


# ----------------------------------------------------------------------------------- recording, with groups


def recording():
    """parlab.core.probe's recording, with the group of each call ("group": its sorted global ranks) and a
    send's or receive's partner as a global rank ("peer")."""
    return probe.recording(keep_sent_data=False, with_groups=True)


# ----------------------------------------------------------------------------------------- part 1: groups


def torch_groups(mesh_group, layouts: list[dict[str, int]]) -> list[dict]:
    """Rank code: for each layout, torch's DeviceMesh groups of this rank and what your function says."""
    rank, out = dist.get_rank(), []
    for axes in layouts:
        mesh = DeviceMesh(axes)  # torch's init_device_mesh: one process group per axis
        torch_says = {axis: sorted(dist.get_process_group_ranks(mesh.group(axis))) for axis in axes}
        yours = {axis: [int(r) for r in mesh_group(rank, dict(axes), axis)] for axis in axes}
        out.append({"torch": torch_says, "yours": yours})
    return out


def collect_groups(mesh_group) -> dict:
    live = list(parlab.launch(torch_groups, WORLD, mesh_group, LIVE_MESHES, **LAUNCH))
    large = []
    for axes in LARGE_MESHES:
        n = math.prod(axes.values())
        large.append(
            [{axis: [int(r) for r in mesh_group(rank, dict(axes), axis)] for axis in axes} for rank in range(n)]
        )
    return {"live": live, "large": large}


def row_major_group(rank: int, axes: dict[str, int], axis: str) -> list[int]:
    """The ranks of `rank`'s group along `axis` in torch's layout: torch.arange(world).view(sizes), row-major."""
    grid = torch.arange(math.prod(axes.values())).view(*axes.values())
    rows = grid.movedim(list(axes).index(axis), -1).reshape(-1, axes[axis])  # every group along `axis`, one a row
    return next(row.tolist() for row in rows if rank in row.tolist())


def judge_groups(data) -> list[str]:
    lines = []
    for i, axes in enumerate(LIVE_MESHES):
        wrong = sum(
            data["live"][r][i]["yours"][axis] != data["live"][r][i]["torch"][axis]
            for r in range(WORLD)
            for axis in axes
        )
        what = f"{_shape(axes)} on 8 ranks: (rank, axis) pairs whose group differs from torch's DeviceMesh"
        lines.append(check_equal(what, wrong, 0).line)
    for i, axes in enumerate(LARGE_MESHES):
        yours = data["large"][i]
        wrong = sum(
            yours[r][axis] != row_major_group(r, axes, axis) for r in range(math.prod(axes.values())) for axis in axes
        )
        what = f"{_shape(axes)}: (rank, axis) pairs whose group differs from torch's row-major layout"
        lines.append(check_equal(what, wrong, 0).line)
    return lines


# -------------------------------------------------------------------------------------- part 2: the step


def full_weights(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The L blocks' full weights (W1: [F, H], W2: [H, F]), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(F, H, generator=gen, dtype=torch.float64) / H**0.5,
            torch.randn(H, F, generator=gen, dtype=torch.float64) / F**0.5,
        )
        for _ in range(L)
    ]


def full_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch x: [B, H] and its target: [B, H], the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, generator=gen, dtype=torch.float64), torch.randn(B, H, generator=gen, dtype=torch.float64)


def mlp_block(h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tp_group) -> torch.Tensor:
    """One Megatron MLP block on this rank's slices, h: [b, H] -> [b, H]. w1: [F/T, H] (rows of W1, column-
    parallel), w2: [H, F/T] (columns of W2, row-parallel). f and g talk over `tp_group`."""
    a = torch.relu(copy_to_tensor_parallel(h, "mlp", tp_group) @ w1.T)  # [b, F/T]: f, identity forward
    return h + reduce_from_tensor_parallel(a @ w2.T, "mlp", tp_group)  # [b, H]: g sums the T partial products


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean over the rows of |out - target|^2: out, target [rows, H]."""
    return ((out - target) ** 2).sum(dim=1).mean()


def stage_blocks(mesh: DeviceMesh) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The blocks this rank holds: its stage's (L / S consecutive blocks), and of each its tp slices."""
    s, S = mesh.index("pp"), mesh.size("pp")
    t, T = mesh.index("tp"), mesh.size("tp")
    ids = list(range(s * L // S, (s + 1) * L // S))
    k = F // T
    weights = full_weights()
    blocks = [
        (
            weights[i][0][t * k : (t + 1) * k].clone().requires_grad_(),  # [F/T, H]
            weights[i][1][:, t * k : (t + 1) * k].clone().requires_grad_(),
        )  # [H, F/T]
        for i in ids
    ]
    return ids, blocks


def run_step(hybrid_step, layouts: list[dict[str, int]]) -> list[dict]:
    """Rank code: for each layout, build the mesh, deal out the blocks, run your step once, recording every call."""
    out = []
    for axes in layouts:
        mesh = DeviceMesh(axes)
        ids, blocks = stage_blocks(mesh)
        x, target = full_batch()
        x.requires_grad_()  # x stands for an embedding's output: its gradient is wanted too
        with recording() as calls:
            loss = hybrid_step(mesh, blocks, x, target)
        out.append(
            {
                "coords": dict(mesh.coords),
                "groups": {axis: sorted(mesh.ranks(axis)) for axis in ("dp", "pp", "tp")},
                "ids": ids,
                "loss": None if loss is None else torch.as_tensor(loss, dtype=torch.float64).detach().reshape(()),
                "grads": [[w.grad for w in block] for block in blocks],
                "calls": calls,
            }
        )
    return out


def single_device() -> dict:
    """One device: the whole batch through the L full blocks."""
    blocks = [(w1.requires_grad_(), w2.requires_grad_()) for w1, w2 in full_weights()]
    h, target = full_batch()
    for w1, w2 in blocks:
        h = h + torch.relu(h @ w1.T) @ w2.T
    loss = loss_fn(h, target)
    loss.backward()
    return {"loss": loss.detach(), "grads": [(w1.grad, w2.grad) for w1, w2 in blocks]}


def step_theory(axes: dict[str, int], coords: dict[str, int]) -> dict:
    """What one rank hands to each axis' group in one step (payload bytes)."""
    S, D, T, e = axes.get("pp", 1), axes.get("dp", 1), axes.get("tp", 1), 8
    s, blocks, message = coords["pp"], L // S, B // D * H * e  # one [b, H] activation or gradient
    sends = ([("send", +1)] if s < S - 1 else []) + ([("send", -1)] if s > 0 else [])
    recvs = ([("recv", -1)] if s > 0 else []) + ([("recv", +1)] if s < S - 1 else [])
    return {
        "tp": 2 * blocks * message,  # f (backward) and g (forward) of every block
        "pp": sorted((op, step, message) for op, step in sends + recvs),
        "dp": blocks * 2 * (F // T) * H * e,  # all of this rank's gradients
    }


def axis_of(call: dict, groups: dict[str, list[int]]) -> str | None:
    """The axis whose group the call ran on (None: not one of the rank's axis groups)."""
    return next((axis for axis, ranks in groups.items() if call["group"] == ranks), None)


def _per_axis(result: dict) -> dict:
    """A rank's calls by axis: all-reduce bytes on tp and dp, (op, stage step, bytes) of its pp messages, and the
    number of calls on no axis of its own (or a kind of call its axis does not use)."""
    groups, coords = result["groups"], result["coords"]
    pp_ranks = groups["pp"]
    got = {"tp": 0, "dp": 0, "pp": [], "stray": 0}
    for call in result["calls"]:
        axis = axis_of(call, groups)
        if axis in ("tp", "dp") and call["op"] == "allreduce":
            got[axis] += int(call["bytes"])
        elif axis == "pp" and call["op"] in probe.P2P and call["peer"] in pp_ranks:
            got["pp"].append((call["op"], pp_ranks.index(call["peer"]) - coords["pp"], int(call["bytes"])))
        else:
            got["stray"] += 1
    got["pp"] = sorted(got["pp"])
    return got


def collect_step(hybrid_step) -> dict:
    return {"ranks": list(parlab.launch(run_step, WORLD, hybrid_step, STEP_MESHES, **LAUNCH))}


def judge_step(data) -> list[str]:
    reference, lines = single_device(), []
    for i, axes in enumerate(STEP_MESHES):
        results = [rank[i] for rank in data["ranks"]]
        shape = _shape(axes)
        T = axes["tp"]
        k = F // T
        last = [res for res in results if res["coords"]["pp"] == axes["pp"] - 1 and res["coords"]["tp"] == 0]
        losses = [res["loss"] for res in last]
        loss = None if None in losses else sum(losses) / len(losses)  # one per replica: their mean
        lines.append(compare(f"{shape}: loss, the mean over the replicas", loss, reference["loss"]).line)
        yours, expected = [], []
        for res in results:
            t = res["coords"]["tp"]
            for block, grads in zip(res["ids"], res["grads"], strict=True):
                w1, w2 = reference["grads"][block]
                yours += list(grads)
                expected += [w1[t * k : (t + 1) * k], w2[:, t * k : (t + 1) * k]]
        lines.append(compare(f"{shape}: every rank's gradient slices", yours, expected).line)
        per_axis = [_per_axis(res) for res in results]
        theory = [step_theory(axes, res["coords"]) for res in results]
        stray = sum(got["stray"] for got in per_axis)
        lines.append(check_equal(f"{shape}: calls not on one of the rank's own axis groups", stray, 0).line)
        for axis, what in [
            ("tp", "tp all-reduce bytes"),
            ("pp", "sends and receives with its pipeline neighbours"),
            ("dp", "dp all-reduce bytes"),
        ]:
            wrong = sum(got[axis] != th[axis] for got, th in zip(per_axis, theory, strict=True))
            lines.append(check_equal(f"{shape}: ranks whose {what} differ from theory", wrong, 0).line)
    return lines


# ------------------------------------------------------------------------------------ traffic prediction

PREDICTED = ("tp_bytes", "pp_bytes", "dp_bytes")


def collect_traffic(predicted: dict, hybrid_step) -> dict:
    rank0 = parlab.launch(run_step, WORLD, hybrid_step, [TRAFFIC_MESH], **LAUNCH)[0][0]
    got = _per_axis(rank0)
    measured = {
        "tp_bytes": got["tp"],
        "pp_bytes": sum(b for op, _, b in got["pp"] if op == "send"),
        "dp_bytes": got["dp"],
    }
    return {"predicted": {k: plain(predicted.get(k)) for k in PREDICTED}, "measured": measured}


def judge_traffic(data) -> list[str]:
    theory = step_theory(TRAFFIC_MESH, mesh_coords(0, TRAFFIC_MESH))
    theory = {
        "tp_bytes": theory["tp"],
        "pp_bytes": sum(b for op, _, b in theory["pp"] if op == "send"),
        "dp_bytes": theory["dp"],
    }
    labels = {
        "tp_bytes": "rank 0: bytes all-reduced on tp in one step",
        "pp_bytes": "rank 0: bytes sent on pp in one step",
        "dp_bytes": "rank 0: bytes all-reduced on dp in one step",
    }
    lines = []
    for key in PREDICTED:
        lines += prediction_lines(labels[key], data["predicted"][key], theory[key], data["measured"][key])
    return lines


# ------------------------------------------------------------------------------------------ part 3: memory


def layouts_of(world: int, cfg: GPTConfig = CFG) -> list[dict[str, int]]:
    """Every dp x pp x tp layout of `world` ranks that the hybrid can run the GPT `cfg` on."""
    found = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) or cfg.heads % tp or cfg.vocab_size % tp or cfg.layers % pp:
                continue
            found.append({"dp": world // (tp * pp), "pp": pp, "tp": tp})
    return found


def measure_states(layouts: list[dict[str, int]]) -> list[dict[str, int]]:
    """Rank code: one step of the GPT with DP x PP x TP and ZeRO-1 over dp (Adam) for each layout; the bytes of
    parameters, gradients and optimizer states this rank holds afterwards, counted from its tensors."""
    out = []
    for axes in layouts:
        mesh = DeviceMesh(axes)
        schedule = make_schedule("1f1b", axes["pp"], 2)  # 2 micro-batches of a 8-row batch per replica
        batches = make_batches(CFG, 8, 1, seed=0)
        result = train_hybrid(build_model(CFG, 0), mesh, schedule, batches, optimizer="adam", lr=0.01, zero_stage=1)
        out.append({kind: result["state_bytes"][kind] for kind in KINDS})
    return out


def _as_states(value) -> dict | str:
    try:
        return {kind: float(value[kind]) for kind in KINDS}
    except (TypeError, KeyError, ValueError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"[:80]


def collect_memory(state_bytes) -> dict:
    measured = [list(rank) for rank in parlab.launch(measure_states, WORLD, MEASURED_MESHES, **LAUNCH)]
    yours = {
        _shape(axes): [_as_states(state_bytes(CFG, dict(axes), rank)) for rank in range(WORLD)]
        for axes in MEASURED_MESHES + layouts_of(WORLD)
    }
    return {"measured": measured, "yours": yours}


def planner_states(axes: dict[str, int]) -> float:
    """The planner's model states on the busiest device: float64 params and grads, Adam's master, m, v (24 bytes)."""
    spec = ModelSpec(CFG.layers, CFG.hidden, CFG.heads, CFG.seq_len, CFG.vocab_size, CFG.ffn, CFG.tied)
    plan = Plan(dp=axes["dp"], tp=axes["tp"], pp=axes["pp"], zero=1)
    device = estimate(spec, Cluster(WORLD, float("inf")), plan, batch=8, bytes_per=(8, 8, 24)).device_bytes
    return device["params"] + device["grads"] + device["optimizer"]


def judge_memory(data) -> list[str]:
    lines = []
    for i, axes in enumerate(MEASURED_MESHES):
        yours = data["yours"][_shape(axes)]
        for kind in KINDS:
            wrong = sum(not isinstance(y, dict) or y[kind] != data["measured"][r][i][kind] for r, y in enumerate(yours))
            what = f"{_shape(axes)}: ranks whose {kind} bytes differ from what the ranks held (measured)"
            lines.append(check_equal(what, wrong, 0).line)
    off = []
    for axes in layouts_of(WORLD):
        yours = data["yours"][_shape(axes)]
        if not all(isinstance(y, dict) for y in yours):
            off.append(_shape(axes))
            continue
        busiest, planner = max(sum(y.values()) for y in yours), planner_states(axes)
        if abs(busiest - planner) > PLANNER_RTOL * planner:
            off.append(_shape(axes))
    what = f"layouts of 8 ranks whose busiest rank is off the planner's estimate by more than {PLANNER_RTOL:.1%}"
    lines.append(check_equal(what, len(off), 0).line)
    return lines


def collect_memory_at_scale(predicted) -> dict:
    return {"predicted": plain(predicted)}


def judge_memory_at_scale(data) -> list[str]:
    cluster = Cluster(devices=1024, memory=80e9)
    device = estimate(GPT3, cluster, GPT3_PLAN, GPT3_BATCH).device_bytes  # mixed precision: 2 + 2 + 12 bytes
    theory = (device["params"] + device["grads"] + device["optimizer"]) / 1e9
    label = f"GPT-3 175B, {GPT3_PLAN}: GB of model states on the busiest GPU"
    return prediction_lines(label, data["predicted"], theory)
