"""Lab 10's checks: PyTorch's own tensor parallelism (DTensor's `parallelize_module`) on the lab model with fewer K/V
heads than ranks (one K/V head, two ranks: k and v cannot be split by heads), planned by the student: Megatron's splits
with the K/V projections replicated and their gradient synced where it is narrowest, a prediction of that plan's
collectives, a plan with Megatron's traffic, the vocabulary-parallel embedding, head and loss, and Megatron's sequence
parallelism.

Every check builds the lab model (parlab.core.lab_model, float64, the same seed on every rank), applies the student's
plan on a one-axis "tp" DeviceMesh of P ranks (gloo, CPU), runs one forward and backward of the lab loss, and
compares the loss and every gradient (DTensors gathered to full shape, Partial ones summed) with the model on one
device. Beyond the numbers it sees:

- every collective each rank ran, with its payload and when (forward, loss, backward). DTensor issues its
  collectives as functional ops that go straight to C++ (parlab.core.probe, which listens to the Python process
  group, sees none of them), so `Collectives` listens at PyTorch's dispatcher, as torch's own CommDebugMode does:
  it lets DTensor turn each op into local ops and collectives first, then records the collectives;
- each weight's placement, the logits' placement, and the local shape of what each block receives;
- calls into parlab's own twin code (parlab/twins/, lesson 10's helpers: `LIBRARY`), which has a plan for the
  reference GPT (parlab/grading/labs/guard.py).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import parlab
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model, lab_batches, lab_loss
from parlab.core.probe import _tensors
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line

LAUNCH = {"timeout": 60, "echo": False}  # a hang stops after 60 s and names the ranks
P, BATCH, SEED = 2, 2, 0  # the tp mesh's ranks; sequences per batch; the lab model's seed
# V = 64, T = 16, H = 32, nq = 4, F = 64, two layers, untied head, float64; one K/V head (nkv = 1 < P): every rank
# needs the whole K/V head, which a split by output features (ColwiseParallel) would cut in half.
CFG = LabConfig(kv_heads=1)
TIED = dataclasses.replace(CFG, tied=True)  # the head is the embedding matrix
LIBRARY = ("twins/", "lessons/twins.py")
ROWS = ("attn.q", "mlp.gate", "mlp.up")  # Megatron: split by output features (W's rows)
KV = ("attn.k", "attn.v")  # the one K/V head: whole on every rank (a Replicate DTensor, or a plain weight)
LINEARS = (*ROWS[:1], *KV, "attn.o", *ROWS[1:], "mlp.down")  # the blocks' nn.Linear modules
COLUMNS = ("attn.o", "mlp.down")  # split by input features (W's columns)

STRUCTURAL = {
    "tp_plan": "the plan's keys exactly the blocks' nn.Linear modules (one style each, nothing else); the loss and "
    "every gradient (gathered to full shape, on every rank) equal one device's lab model; q, gate, up sharded by "
    "rows, o, down by columns, k and v whole on every rank (the one K/V head), the embedding, norms and head whole; "
    "every gradient complete on every rank after backward (none Partial: ready for the update); forward: one "
    "all-reduce of [B, T, H] per sub-layer and nothing else; backward: one all-reduce of [B, T, H] per column-"
    "parallel Linear (q, gate, up) and one of [B, T, nkv hd] for each of k and v (their gradient summed where it is "
    "narrowest), nothing else; no call into parlab's twin code",
    "layer_collectives": "the predicted all-reduces per layer and step of the part-1 plan (forward, backward) and "
    "their payload per rank, against the grader's theory (exact); your part-1 plan's measured counts shown beside it "
    "once the prediction is right and the plan has part 1's traffic (else a line says it does not)",
    "megatron_plan": "as tp_plan without the keys' rule, and exactly one all-reduce of [B, T, H] per sub-layer in "
    "backward too (Megatron's f), whatever the number of Linears that read its input, beside k's and v's [B, T, nkv "
    "hd] syncs; every gradient complete",
    "vocab_parallel": "untied and tied head: the loss and every gradient equal one device's, every gradient complete; "
    "the embedding and head sharded over the vocabulary; the logits a DTensor sharded on the vocabulary (the "
    "[B, T, V] logits never travel: the loss's collectives move at most B T numbers each); forward: one all-reduce "
    "of [B, T, H] per sub-layer and one for the embedding; backward: one per sub-layer and one for the head, and "
    "k's and v's [B, T, nkv hd] syncs; nothing else; no call into parlab's twin code",
    "sequence_parallel": "the loss and every gradient (the norms' Partial gradients summed; every other gradient "
    "complete) equal one device's; every block and the final norm receive this rank's T/P tokens; logits sharded on "
    "the vocabulary; forward and backward each exactly 2L+1 reduce-scatters of [B, T, H] and 2L+1 all-gathers of "
    "[B, T/P, H] (the embedding reduce-scattered, never all-reduced), in backward k's and v's [B, T, nkv hd] syncs, "
    "the loss's small all-reduces, nothing else; no call into parlab's twin code",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ---------------------------------------------------------------------------------------------- what torch sends

# Operator name (without namespace or trailing underscore) -> kind, for the c10d and the functional ops.
KINDS = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "send": "send",
    "recv": "recv",
}
OUTPUT_FIRST = {"_allgather_base", "allgather", "_reduce_scatter_base", "reduce_scatter", "alltoall", "alltoall_base"}


class Collectives(TorchDispatchMode):
    """Every collective this rank runs inside the block, DTensor's included: `calls`, a list of [kind, bytes, phase].

    bytes: the payload this rank hands over (parlab.core.comm's convention: an all-gather's input, a
    reduce-scatter's whole input). phase: whatever `self.phase` says when the call is made."""

    def __init__(self):
        super().__init__()
        self.calls: list[list] = []
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns the op into local ops and collectives, which come back here
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            name = func.__name__.split(".")[0].rstrip("_")
            if name in KINDS:
                payload = args[1] if name in OUTPUT_FIRST and len(args) > 1 else (args[0] if args else ())
                nbytes = sum(t.numel() * t.element_size() for t in _tensors(payload))
                self.calls.append([KINDS[name], int(nbytes), self.phase])
        return out


# ------------------------------------------------------------------------------------------------ the run


def _local(t) -> torch.Tensor | None:
    """What this rank holds of a tensor (a DTensor's local piece), detached, on the host; None stays None."""
    if t is None:
        return None
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().cpu().clone()


def _placement(t) -> str:
    """'Shard(dim=0)', 'Replicate()', ... for a DTensor; 'whole' for a plain tensor."""
    return repr(t.placements[0]) if hasattr(t, "placements") else "whole"


def _local_shape(t) -> list[int]:
    t = t.to_local() if hasattr(t, "to_local") else t
    return list(t.shape) if isinstance(t, torch.Tensor) else []


def _take_input(inputs: list, module, args) -> None:
    """A forward pre-hook: what a block (or the final norm) receives, as this rank holds it."""
    inputs.append(_local_shape(args[0]))


def _take_logits(record: Collectives, logits: list, module, args, output) -> None:
    """A forward hook on the model: the logits as it returns them. The loss comes next; backward begins when
    dL/dlogits arrives."""
    logits.append({"placement": _placement(output), "local": _local_shape(output)})
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(lambda grad: setattr(record, "phase", "backward"))
    record.phase = "loss"


def check_loss(model, x: torch.Tensor, y: torch.Tensor):
    """The loss parts 1 and 2 are checked with: the lab loss of the model's (whole) logits, and its backward."""
    loss = lab_loss(model(x), y)
    loss.backward()
    return loss


def run_plan(answer, kind: str, loss_backward, configs: list[LabConfig]) -> dict:
    """Rank code: for each config, the lab model on every rank, parallelized by the answer on a "tp" mesh of P ranks
    (kind "plan": answer(model) is a parallelize_module plan; "apply": answer(model, mesh) parallelizes the model
    itself), then loss_backward(model, x, y) on the whole batch, its collectives recorded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(parlab.device().type, (P,), mesh_dim_names=("tp",))
    out = []
    for cfg in configs:
        model = build_lab_model(cfg, SEED, device=parlab.device())
        x, y = lab_batches(cfg, BATCH, 1, SEED, device=parlab.device())[0]
        keys: list[str] = []
        with library_calls(LIBRARY) as called:
            if kind == "plan":
                plan = answer(model)
                keys = sorted(str(name) for name in plan) if isinstance(plan, dict) else []
                parallelize_module(model, mesh, plan)
            else:
                answer(model, mesh)
        record = Collectives()
        inputs, logits = [], []
        hooks = [b.register_forward_pre_hook(partial(_take_input, inputs)) for b in model.blocks]
        hooks.append(model.norm.register_forward_pre_hook(partial(_take_input, inputs)))
        hooks.append(model.register_forward_hook(partial(_take_logits, record, logits)))
        record.phase = "forward"
        # The student's loss function runs under the library hook too (a profile hook: it slows DTensor's Python
        # down a few times, so the check's own loss runs without it).
        with record, library_calls(LIBRARY if loss_backward is not check_loss else ()) as called_loss:
            loss = loss_backward(model, x, y)
        for hook in hooks:
            hook.remove()
        out.append(
            {
                "loss": _local(loss),
                # Each rank's own piece of every gradient, and its placement: the judge puts them together (the
                # gathers would cost more collectives than the step itself).
                "grads": {name: _local(p.grad) for name, p in model.named_parameters()},
                "grad_placements": {name: _placement(p.grad) for name, p in model.named_parameters()},
                "placements": {name: _placement(p) for name, p in model.named_parameters()},
                "calls": record.calls,
                "inputs": inputs,
                "logits": logits[:1],
                "library": [*called, *called_loss],
                "plan_keys": keys,
            }
        )
    return {"configs": out}


def collect(answer, kind: str, loss_backward, configs: list[LabConfig]) -> dict:
    return {"ranks": list(parlab.launch(run_plan, P, answer, kind, loss_backward, configs, **LAUNCH))}


# ------------------------------------------------------------------------------------------------ the verdicts


def reference(cfg: LabConfig) -> dict:
    """The lab model on one device: the loss and every gradient of one batch."""
    model = build_lab_model(cfg, SEED)
    x, y = lab_batches(cfg, BATCH, 1, SEED)[0]  # host: the reference on one device
    loss = lab_loss(model(x), y)
    loss.backward()
    return {"loss": loss.detach(), "grads": {name: p.grad for name, p in model.named_parameters()}}


def full_grads(ranks: list[dict]) -> list[dict[str, torch.Tensor | None]]:
    """Each rank's view of every full gradient, from the pieces the ranks returned: a Shard(d) gradient is the
    ranks' pieces side by side along d, a Partial one their sum, a whole (or Replicate) one the rank's own."""
    views = [{} for _ in ranks]
    for name in ranks[0]["grads"]:
        pieces = [res["grads"].get(name) for res in ranks]
        placement = ranks[0]["grad_placements"].get(name, "whole")
        for r, res in enumerate(ranks):
            if any(p is None for p in pieces) or res["grad_placements"].get(name) != placement:
                views[r][name] = pieces[r] if placement in ("whole", "Replicate()") else None
            elif placement.startswith("Shard(dim="):
                views[r][name] = torch.cat(pieces, dim=int(placement[len("Shard(dim=") : -1]))
            elif placement.startswith("Partial"):
                views[r][name] = sum(pieces)
            else:
                views[r][name] = pieces[r]
    return views


def numbers_lines(label: str, ranks: list[dict], ref: dict) -> list[str]:
    """The loss on every rank, then every gradient on every rank: the first wrong rank and parameter named."""
    lines = []
    ranks = [{**res, "grads": view} for res, view in zip(ranks, full_grads(ranks), strict=True)]
    for r, res in enumerate(ranks):
        verdict = compare(f"{label}loss: rank {r}", res["loss"], ref["loss"])
        if not verdict.passed:
            lines.append(verdict.line)
            break
    else:
        lines.append(compare(f"{label}loss on every rank", [res["loss"] for res in ranks], [ref["loss"]] * P).line)
    what = f"{label}every gradient, full shape, on every rank"
    for r, res in enumerate(ranks):
        for name, grad in ref["grads"].items():
            verdict = compare(f"{what}: rank {r}, {name}", res["grads"].get(name), grad)
            if not verdict.passed:
                lines.append(verdict.line)
                return lines
    lines.append(compare(what, [res["grads"] for res in ranks], [ref["grads"]] * P).line)
    return lines


def expected_placements(cfg: LabConfig, vocab: bool) -> dict[str, str | tuple[str, ...]]:
    """Megatron's splits of the blocks (and, with vocab, of the embedding and head); k and v whole on every rank (a
    Replicate DTensor or a plain weight: either holds the one K/V head whole); the rest whole."""
    names = build_lab_model(cfg, SEED).state_dict()
    placements: dict[str, str | tuple[str, ...]] = {name: "whole" for name in names}
    for i in range(cfg.layers):
        placements |= {f"blocks.{i}.{m}.weight": "Shard(dim=0)" for m in ROWS}
        placements |= {f"blocks.{i}.{m}.weight": ("Replicate()", "whole") for m in KV}
        placements |= {f"blocks.{i}.{m}.weight": "Shard(dim=1)" for m in COLUMNS}
    if vocab:
        placements["embed.weight"] = "Shard(dim=0)"  # rank r: the embedding rows of its V/P tokens
        if not cfg.tied:
            placements["head.weight"] = "Shard(dim=0)"  # and their rows of the head: its columns of the logits
    return placements


def placements_line(label: str, ranks: list[dict], expected: dict[str, str | tuple[str, ...]], what: str) -> str:
    text = f"{label}{what}"
    for r, res in enumerate(ranks):
        for name, placement in expected.items():
            accepted = placement if isinstance(placement, tuple) else (placement,)
            got = res["placements"].get(name, "missing")
            if got not in accepted:
                return f"{text}: rank {r}, {name}: expected {' or '.join(accepted)}, received {got}: FAIL"
    return f"{text}: PASS"


def complete_line(label: str, ranks: list[dict], exempt: tuple[str, ...] = ()) -> str:
    """Every gradient complete on every rank after backward: none left Partial (a sum still owed by the ranks),
    except the parameters whose names contain one of `exempt` (the norms' gains under sequence parallelism)."""
    what = f"{label}every gradient complete on every rank after backward (none Partial)"
    what += ", the norms' gains excepted" if exempt else ""
    for r, res in enumerate(ranks):
        for name, placement in res["grad_placements"].items():
            if placement.startswith("Partial") and not any(e in name for e in exempt):
                return f"{what}: rank {r}, {name}: expected a complete gradient, received {placement}: FAIL"
    return f"{what}: PASS"


def plan_keys_line(ranks: list[dict], cfg: LabConfig) -> str:
    """The plan names each of the blocks' nn.Linear modules once, and nothing else."""
    expected = {f"blocks.{i}.{m}" for i in range(cfg.layers) for m in LINEARS}
    what = f"plan: one style for each nn.Linear of the blocks ({len(expected)} keys), nothing else"
    got = set(ranks[0]["plan_keys"])
    if got != expected:
        extra, missing = sorted(got - expected), sorted(expected - got)
        shown = "; ".join(
            f"{kind} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for kind, names in (("extra", extra), ("missing", missing))
            if names
        )
        return f"{what}: {shown}: FAIL"
    return f"{what}: PASS"


def _count(calls: list[list], phase: str) -> dict[tuple[str, int], int]:
    counts: dict[tuple[str, int], int] = {}
    for kind, nbytes, where in calls:
        if where == phase:
            counts[(kind, nbytes)] = counts.get((kind, nbytes), 0) + 1
    return counts


def _listed(counts: dict[tuple[str, int], int]) -> str:
    return ", ".join(f"{n} {kind} of {nbytes} bytes" for (kind, nbytes), n in sorted(counts.items())) or "nothing"


def traffic_line(what: str, ranks: list[dict], phase: str, expected: dict[tuple[str, int], int], small: int = 0) -> str:
    """Every rank ran exactly `expected` ({(kind, bytes): count}) in `phase`, in any order, besides any all-reduces
    of at most `small` bytes (the loss's); else the first rank that did not, what it ran and what was expected."""
    for r, res in enumerate(ranks):
        counts = _count(res["calls"], phase)
        counts = {key: n for key, n in counts.items() if not (key[0] == "all_reduce" and key[1] <= small)}
        if counts != expected:
            return f"{what}: rank {r} ran {_listed(counts)}, expected {_listed(expected)}: FAIL"
    return f"{what}: PASS"


def _activation(cfg: LabConfig) -> int:
    """Bytes of one [B, T, H] activation."""
    return BATCH * cfg.seq_len * cfg.hidden * cfg.dtype_bytes


def _kv_sync(cfg: LabConfig) -> int:
    """Bytes of the gradient of k's (or v's) output, [B, T, nkv hd]: where the K/V head's gradient is narrowest."""
    return BATCH * cfg.seq_len * cfg.kv_heads * cfg.head_size * cfg.dtype_bytes


def _library_line(ranks: list[dict]) -> str:
    called = sorted({name for res in ranks for config in res["configs"] for name in config["library"]})
    return library_line("plan", called, "parlab's twin code")


def _configs(data: dict, index: int) -> list[dict]:
    return [res["configs"][index] for res in data["ranks"]]


def block_lines(data: dict, backward_activations: int) -> list[str]:
    """Parts 1 and 2: the numbers, the placements, complete gradients, and the all-reduces of each direction: in
    backward `backward_activations` of [B, T, H] and one [B, T, nkv hd] for each of k and v per layer."""
    ranks, L, act, kv = _configs(data, 0), CFG.layers, _activation(CFG), _kv_sync(CFG)
    lines = numbers_lines("", ranks, reference(CFG))
    lines.append(
        placements_line(
            "",
            ranks,
            expected_placements(CFG, vocab=False),
            "q, gate, up split by rows, o, down by columns, k and v whole on every rank, the rest whole",
        )
    )
    lines.append(complete_line("", ranks))
    lines.append(
        traffic_line(
            f"forward, every rank: one all-reduce of [B, T, H] per sub-layer ({2 * L}), nothing else",
            ranks,
            "forward",
            {("all_reduce", act): 2 * L},
        )
    )
    lines.append(
        traffic_line(
            f"backward, every rank: {backward_activations} all-reduces of [B, T, H] and {len(KV) * L} of "
            "[B, T, nkv hd] (k's and v's gradients), nothing else",
            ranks,
            "backward",
            {("all_reduce", act): backward_activations, ("all_reduce", kv): len(KV) * L},
        )
    )
    lines.append(_library_line(data["ranks"]))
    return lines


# ------------------------------------------------------------------------------------- 1 · the blocks' plan


_MEASURED: dict = {}  # the last tp_plan check's data, by the plan function it ran: the prediction shows it


def collect_tp_plan(tp_plan) -> dict:
    data = collect(tp_plan, "plan", check_loss, [CFG])
    _MEASURED.clear()
    _MEASURED[id(tp_plan)] = (tp_plan, data)
    return data


def judge_tp_plan(data) -> list[str]:
    return [plan_keys_line(_configs(data, 0), CFG), *block_lines(data, len(ROWS) * CFG.layers)]


# ---------------------------------------------------------------------------------------- the prediction


def layer_collectives_theory(cfg: LabConfig = CFG, batch: int = BATCH) -> dict[str, int]:
    """Per layer and step, part 1's plan (one style per Linear, the one K/V head whole on every rank, every gradient
    complete after backward, the fewest bytes): a RowwiseParallel leaves a Partial output, made Replicate by one
    all-reduce of [B, T, H] (o, down: one per sub-layer in forward). In backward each ColwiseParallel turns its
    plain input into a Replicate DTensor of its own, whose gradient comes back Partial and is all-reduced on its own
    (q, gate, up: one [B, T, H] each). k and v are whole, but each rank's gradient of their output holds only its
    own query heads' share: summed over the ranks where it is [B, T, nkv hd] (narrower than x's [B, T, H], and it
    leaves the weights' gradients and x's share complete)."""
    activation = batch * cfg.seq_len * cfg.hidden * cfg.dtype_bytes
    kv = batch * cfg.seq_len * cfg.kv_heads * cfg.head_size * cfg.dtype_bytes
    forward, backward = len(COLUMNS), len(ROWS) + len(KV)
    return {
        "forward_all_reduces": forward,
        "backward_all_reduces": backward,
        "payload_bytes": (forward + len(ROWS)) * activation + len(KV) * kv,
    }


THEORY = {"layer_collectives": layer_collectives_theory}
PREDICTED = ("forward_all_reduces", "backward_all_reduces", "payload_bytes")


def _plain(value) -> float | str:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_layer_collectives(predicted: dict, tp_plan) -> dict:
    """The predictions, and (shown, not scored) what the part-1 plan measures per layer."""
    data = {"predicted": {name: _plain(predicted.get(name)) for name in PREDICTED}}
    if id(tp_plan) in _MEASURED and _MEASURED[id(tp_plan)][0] is tp_plan:  # part 1's check ran this very plan
        data["ranks"] = _MEASURED[id(tp_plan)][1]["ranks"]
        return data
    try:
        data["ranks"] = collect_tp_plan(tp_plan)["ranks"]
    except Exception as exc:  # the plan of part 1 does not run: the prediction is judged on its own
        data["measured_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc) else ''}"
    return data


def judge_layer_collectives(data) -> list[str]:
    theory, predicted = layer_collectives_theory(), data["predicted"]
    labels = {
        "forward_all_reduces": "all-reduces per layer, forward",
        "backward_all_reduces": "all-reduces per layer, backward",
        "payload_bytes": "all-reduce payload per rank, one layer, one step",
    }
    lines = []
    for name, label in labels.items():
        lines += prediction_lines(label, predicted[name], theory[name], rtol=0)
    if not all(line.endswith(": PASS") for line in lines if line.endswith((": PASS", ": FAIL"))):
        return lines
    if "ranks" not in data:
        return [*lines, f"your part-1 plan could not be measured ({data.get('measured_error', '')})"]
    # The measurement is shown only when it is part 1's plan's (its keys and traffic as tp_plan's check wants them):
    # another plan's counts would contradict the theory just accepted.
    ranks, L = _configs(data, 0), CFG.layers
    calls = ranks[0]["calls"]
    alls = {phase: [nbytes for kind, nbytes, where in calls if kind == "all_reduce" and where == phase] for phase in
            ("forward", "backward")}  # fmt: skip
    measured = [len(alls["forward"]) / L, len(alls["backward"]) / L, (sum(alls["forward"]) + sum(alls["backward"])) / L]
    part1 = [plan_keys_line(ranks, CFG), *block_lines(data, len(ROWS) * L)[2:]]
    if not all(line.endswith(": PASS") for line in part1):
        return [*lines, "your part-1 plan does not pass tp_plan's check (its keys or traffic): no measurement shown"]
    shown = ", ".join(
        f"{label} {value:g}" for label, value in zip(("forward", "backward", "bytes"), measured, strict=True)
    )
    return [*lines, f"your part-1 plan, measured on rank 0 per layer: {shown}"]


# -------------------------------------------------------------------------------------- 2 · Megatron's traffic


def collect_megatron_plan(megatron_plan) -> dict:
    return collect(megatron_plan, "plan", check_loss, [CFG])


def judge_megatron_plan(data) -> list[str]:
    return block_lines(data, 2 * CFG.layers)


# ------------------------------------------------------------------------ 3 · vocabulary-parallel embedding, head


def collect_vocab_parallel(vocab_plan, loss_backward) -> dict:
    return collect(vocab_plan, "plan", loss_backward, [CFG, TIED])


def logits_line(label: str, ranks: list[dict], cfg: LabConfig) -> str:
    what = f"{label}logits: a DTensor sharded on the vocabulary, [B, T, V/P] on each rank"
    expected = {"placement": "Shard(dim=2)", "local": [BATCH, cfg.seq_len, cfg.vocab_size // P]}
    for r, res in enumerate(ranks):
        got = res["logits"][0] if res["logits"] else {"placement": "none", "local": []}
        if got != expected:
            return (
                f"{what}: rank {r} returned {got['placement']} {got['local']}, expected {expected['placement']} "
                f"{expected['local']}: FAIL"
            )
    return f"{what}: PASS"


def judge_vocab_parallel(data) -> list[str]:
    lines = []
    for index, (name, cfg) in enumerate((("untied head", CFG), ("tied head", TIED))):
        ranks, L, act, kv = _configs(data, index), cfg.layers, _activation(cfg), _kv_sync(cfg)
        label = f"{name}: "
        rows = BATCH * cfg.seq_len * cfg.dtype_bytes  # one number per token: what the loss may all-reduce
        lines += numbers_lines(label, ranks, reference(cfg))
        lines += [
            placements_line(
                label,
                ranks,
                expected_placements(cfg, vocab=True),
                "embedding and head split by vocabulary, the blocks as before, the norms whole",
            ),  # fmt: skip
            complete_line(label, ranks),
            logits_line(label, ranks, cfg),
            traffic_line(
                f"{label}forward, every rank: {2 * L + 1} all-reduces of [B, T, H] (sub-layers, embedding), nothing "
                "else",
                ranks,
                "forward",
                {("all_reduce", act): 2 * L + 1},
            ),
            traffic_line(
                f"{label}loss, every rank: all-reduces of at most B T numbers, nothing else",
                ranks,
                "loss",
                {},
                small=rows,
            ),
            traffic_line(
                f"{label}backward, every rank: {2 * L + 1} all-reduces of [B, T, H] (sub-layers, head) and "
                f"{len(KV) * L} of [B, T, nkv hd] (k, v), nothing else",
                ranks,
                "backward",
                {("all_reduce", act): 2 * L + 1, ("all_reduce", kv): len(KV) * L},
            ),
        ]
    lines.append(_library_line(data["ranks"]))
    return lines


# ---------------------------------------------------------------------------------- 4 · sequence parallelism


def collect_sequence_parallel(apply_sp, loss_backward) -> dict:
    return collect(apply_sp, "apply", loss_backward, [CFG])


def judge_sequence_parallel(data) -> list[str]:
    ranks, cfg = _configs(data, 0), CFG
    L, act, rows = cfg.layers, _activation(cfg), BATCH * cfg.seq_len * cfg.dtype_bytes
    n = 2 * L + 1  # the embedding's reduce-scatter, then two per layer; the final norm's all-gather, two per layer
    mirror = {("reduce_scatter", act): n, ("all_gather", act // P): n}
    kv = {("all_reduce", _kv_sync(cfg)): len(KV) * L}  # k's and v's gradients, summed where they are narrowest
    local = [BATCH, cfg.seq_len // P, cfg.hidden]
    what = "every block and the final norm receive this rank's T/P tokens, [B, T/P, H]"
    shapes = f"{what}: PASS"
    for r, res in enumerate(ranks):
        wrong = [(i, shape) for i, shape in enumerate(res["inputs"]) if shape != local]
        if wrong or len(res["inputs"]) != L + 1:
            where, shape = wrong[0] if wrong else (len(res["inputs"]), "nothing")
            name = f"block {where}" if where < L else "the final norm"
            shapes = f"{what}: rank {r}: {name} received {shape}, expected {local}: FAIL"
            break
    return [
        *numbers_lines("", ranks, reference(cfg)),
        shapes,
        complete_line("", ranks, exempt=("norm",)),
        logits_line("", ranks, cfg),
        traffic_line(
            f"forward, every rank: {n} reduce-scatters of [B, T, H] and {n} all-gathers of [B, T/P, H], nothing else",
            ranks,
            "forward",
            mirror,
        ),
        traffic_line(
            "loss, every rank: all-reduces of at most B T numbers, nothing else", ranks, "loss", {}, small=rows
        ),
        traffic_line(
            f"backward, every rank: {n} reduce-scatters of [B, T, H], {n} all-gathers of [B, T/P, H] and "
            f"{len(KV) * L} all-reduces of [B, T, nkv hd] (k, v), nothing else",
            ranks,
            "backward",
            mirror | kv,
        ),
        _library_line(data["ranks"]),
    ]
