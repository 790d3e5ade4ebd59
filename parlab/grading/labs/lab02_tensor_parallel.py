"""Lab 02's checks: Megatron's conjugate operators f and g, a row-parallel linear layer with its own backward, the
Megatron MLP, a vocabulary-parallel cross-entropy in one collective, and a prediction of a layer's traffic.

Every check runs the student's code on P live ranks, each rank with its slices of the same full problem (float64),
and compares with one device computing the whole thing. `probe.recording` sees every call the code makes into
torch.distributed (library calls included), in forward and in backward separately.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.core.models import GPTConfig, build_model
from parlab.grading.labs import prediction_lines, run_check
from parlab.schemes.tensor_parallel import PER_LAYER_ITEMS, TensorParallelBlock, allreduce_theory

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
P, BATCH, T = 4, 2, 4  # ranks; every activation is [BATCH, T, ...]
H, OUT = 8, 16  # f and g: a column-parallel linear [B, T, H] -> [B, T, OUT]
IN = 16  # the row-parallel linear: x [B, T, IN] -> y [B, T, H]; W: [H, IN]
FFN = 32  # the MLP: [B, T, H] -> [B, T, FFN] -> [B, T, H]
V = 32  # the cross-entropy: logits [N, V] with N = BATCH * T rows
LAYER_CFG = GPTConfig(vocab_size=V, seq_len=T, hidden=H, heads=4, layers=1, ffn=FFN)  # the predicted layer

STRUCTURAL = {
    "conjugates": "f: no communication in forward and exactly one all-reduce of dL/dx ([B, T, H]) in backward; "
    "g: exactly one all-reduce of its input in forward and no communication in backward (seen at the process "
    "group, library calls included); the column-parallel layer built on f gives one device's dL/dx on every rank",
    "row_parallel": "each rank all-reduces exactly one y ([B, T, out]) in forward and nothing else, and makes no "
    "call at all in backward",
    "megatron_mlp": "exactly one all-reduce of [B, T, H] in forward and one in backward on every rank, nothing "
    "else: nothing is exchanged between the two GEMMs",
    "vocab_ce": "the loss from one call into torch.distributed in forward that moves at most 2 numbers per row "
    "from each rank (the [N, V] logits never travel, not even in pieces), none in backward; rows with logits "
    "near 1000 included (exp overflows there without a common shift)",
    "layer_bytes": "the predicted all-reduce payload per rank of one Megatron layer per step against the grader's "
    "theory and against the bytes measured at the process group in parlab's TensorParallelBlock, and the "
    "predicted ring wire bytes against theory",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _calls(calls) -> list[list]:
    """A probe's records as [op, bytes] pairs."""
    return [[str(c["op"]), int(c["bytes"])] for c in calls]


def calls_line(what: str, ranks_calls: list[list[list]], expected: list[list]) -> str:
    """One verdict line: every rank made exactly the calls `expected` ([op, bytes], in order)."""
    wrong = [(r, calls) for r, calls in enumerate(ranks_calls) if [list(c) for c in calls] != expected]
    if not wrong:
        return f"{what}: PASS"
    r, calls = wrong[0]
    shown = ", ".join(f"{op} of {n} bytes" for op, n in calls[:4]) or "nothing"
    return f"{what}: rank {r} made {shown}{' ...' if len(calls) > 4 else ''}: FAIL"


# ---------------------------------------------------------------------------------------- f and g (conjugates)


def conjugates_problem(seed: int = 0) -> dict[str, torch.Tensor]:
    """x: [B, T, H] (replicated), W: [OUT, H], G: [B, T, OUT] = dL/dy; z: [P, B, T, H], rank r's partial sum z[r]
    for g, and Gz: [B, T, H] = dL/d(g's output)."""
    gen = torch.Generator().manual_seed(seed)
    names_shapes = {"x": (BATCH, T, H), "w": (OUT, H), "g": (BATCH, T, OUT), "z": (P, BATCH, T, H), "gz": (BATCH, T, H)}
    return {name: _randn(gen, *shape) for name, shape in names_shapes.items()}


def run_conjugates(copy_to, reduce_from) -> dict:
    """Rank code: f in front of a column-parallel linear (rank r: W's rows [r OUT/P, (r+1) OUT/P)), then g alone."""
    r, k = dist.get_rank(), OUT // P
    data = conjugates_problem()
    x = data["x"].clone().requires_grad_()  # [B, T, H], the same on every rank
    w_r = data["w"][r * k : (r + 1) * k].clone()  # [OUT/P, H]
    with probe.recording(keep_sent_data=False) as f_forward:
        y_r = copy_to.apply(x) @ w_r.T  # [B, T, OUT/P]: rank r's output columns
    with probe.recording(keep_sent_data=False) as f_backward:
        (y_r * data["g"][..., r * k : (r + 1) * k]).sum().backward()
    z = data["z"][r].clone().requires_grad_()  # [B, T, H]: this rank's partial sum
    with probe.recording(keep_sent_data=False) as g_forward:
        total = reduce_from.apply(z)
    with probe.recording(keep_sent_data=False) as g_backward:
        (total * data["gz"]).sum().backward()
    return {
        "y": y_r.detach(),
        "grad_x": x.grad,
        "total": total.detach(),
        "grad_z": z.grad,
        "calls": {
            "f forward": _calls(f_forward),
            "f backward": _calls(f_backward),
            "g forward": _calls(g_forward),
            "g backward": _calls(g_backward),
        },
    }


def collect_conjugates(copy_to, reduce_from) -> dict:
    return {"ranks": list(parlab.launch(run_conjugates, P, copy_to, reduce_from, **LAUNCH))}


def judge_conjugates(data) -> list[str]:
    ranks, ref = data["ranks"], conjugates_problem()
    x, w = ref["x"].clone().requires_grad_(), ref["w"]
    y = x @ w.T
    (y * ref["g"]).sum().backward()
    activation = BATCH * T * H * 8  # bytes of one [B, T, H] float64 tensor
    ys = torch.cat([res["y"] for res in ranks], dim=-1)
    return [
        compare("f, column-parallel y = x W^T: the ranks' columns side by side", ys, y.detach()).line,
        compare("f backward: dL/dx on every rank", [res["grad_x"] for res in ranks], [x.grad] * P).line,
        calls_line("f forward, every rank: no communication", [res["calls"]["f forward"] for res in ranks], []),
        calls_line(
            f"f backward, every rank: one all-reduce of dL/dx ({activation} bytes), nothing else",
            [res["calls"]["f backward"] for res in ranks],
            [["allreduce", activation]],
        ),
        compare(
            "g: the sum of the ranks' z on every rank",
            [res["total"] for res in ranks],
            [ref["z"].sum(0)] * P,
        ).line,
        compare("g backward: dL/dz on every rank", [res["grad_z"] for res in ranks], [ref["gz"]] * P).line,
        calls_line(
            f"g forward, every rank: one all-reduce of z ({activation} bytes), nothing else",
            [res["calls"]["g forward"] for res in ranks],
            [["allreduce", activation]],
        ),
        calls_line("g backward, every rank: no communication", [res["calls"]["g backward"] for res in ranks], []),
    ]


# ------------------------------------------------------------------------------------------- row-parallel linear


def row_problem(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [BATCH, T, IN], W: [H, IN] and a fixed output gradient G: [BATCH, T, H] (the loss is sum(y * G))."""
    gen = torch.Generator().manual_seed(seed)
    return _randn(gen, BATCH, T, IN), _randn(gen, H, IN), _randn(gen, BATCH, T, H)


def run_row_parallel(layer) -> dict:
    """Rank code: this rank's slices through `layer`, then the backward of sum(y * G)."""
    r, k = dist.get_rank(), IN // P
    x, w, g = row_problem()
    x_r = x[..., r * k : (r + 1) * k].clone().requires_grad_()  # [B, T, IN/P]: this rank's slice
    w_r = w[:, r * k : (r + 1) * k].clone().requires_grad_()  # [H, IN/P]
    with probe.recording(keep_sent_data=False) as forward_calls:
        y = layer.apply(x_r, w_r)  # [B, T, H]
    with probe.recording(keep_sent_data=False) as backward_calls:
        (y * g).sum().backward()  # dL/dy = g on every rank
    return {
        "y": y.detach(),
        "grad_x": x_r.grad,
        "grad_w": w_r.grad,
        "forward": _calls(forward_calls),
        "backward": _calls(backward_calls),
    }


def collect_row_parallel(row_parallel) -> dict:
    return {"ranks": list(parlab.launch(run_row_parallel, P, row_parallel, **LAUNCH))}


def judge_row_parallel(data) -> list[str]:
    ranks = data["ranks"]
    x, w, g = (t.requires_grad_() for t in row_problem())
    y = x @ w.T  # [B, T, H]
    (y * g.detach()).sum().backward()
    grad_x = torch.cat([res["grad_x"] for res in ranks], dim=-1)  # the ranks' slices side by side: [B, T, IN]
    grad_w = torch.cat([res["grad_w"] for res in ranks], dim=-1)  # [H, IN]
    return [
        compare("y = x W^T on every rank", [res["y"] for res in ranks], [y.detach()] * P).line,
        compare("dL/dx, the ranks' slices side by side", grad_x, x.grad).line,
        compare("dL/dW, the ranks' slices side by side", grad_w, w.grad).line,
        calls_line(
            f"forward, every rank: one all-reduce of y ({BATCH * T * H * 8} bytes), nothing else",
            [res["forward"] for res in ranks],
            [["allreduce", BATCH * T * H * 8]],
        ),
        calls_line("backward, every rank: no communication", [res["backward"] for res in ranks], []),
    ]


# ----------------------------------------------------------------------------------------------- Megatron MLP


def mlp_problem(seed: int = 2) -> dict[str, torch.Tensor]:
    """x: [B, T, H]; fc: W [FFN, H], b [FFN]; proj: W [H, FFN], b [H]; G: [B, T, H] = dL/dy."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"x": (BATCH, T, H), "fc_w": (FFN, H), "fc_b": (FFN,), "proj_w": (H, FFN), "proj_b": (H,)}
    data = {name: _randn(gen, *shape) for name, shape in shapes.items()}
    data["g"] = _randn(gen, BATCH, T, H)
    return data


def run_mlp(mlp) -> dict:
    """Rank code: rank r holds FFN units [r FFN/P, (r+1) FFN/P): fc's rows, fc's bias, proj's columns."""
    r, k = dist.get_rank(), FFN // P
    data = mlp_problem()
    mine = slice(r * k, (r + 1) * k)
    x = data["x"].clone().requires_grad_()
    weights = {
        "fc_w": data["fc_w"][mine].clone(),  # [FFN/P, H]
        "fc_b": data["fc_b"][mine].clone(),  # [FFN/P]
        "proj_w": data["proj_w"][:, mine].clone(),  # [H, FFN/P]
        "proj_b": data["proj_b"].clone(),  # [H], replicated
    }
    for w in weights.values():
        w.requires_grad_()
    with probe.recording(keep_sent_data=False) as forward_calls:
        y = mlp(x, weights["fc_w"], weights["fc_b"], weights["proj_w"], weights["proj_b"])
    with probe.recording(keep_sent_data=False) as backward_calls:
        (y * data["g"]).sum().backward()
    return {
        "y": y.detach(),
        "grad_x": x.grad,
        "grads": {name: w.grad for name, w in weights.items()},
        "forward": _calls(forward_calls),
        "backward": _calls(backward_calls),
    }


def collect_megatron_mlp(mlp) -> dict:
    return {"ranks": list(parlab.launch(run_mlp, P, mlp, **LAUNCH))}


def judge_megatron_mlp(data) -> list[str]:
    ranks, ref = data["ranks"], mlp_problem()
    leaves = {name: ref[name].clone().requires_grad_() for name in ("x", "fc_w", "fc_b", "proj_w", "proj_b")}
    y = F.linear(F.gelu(F.linear(leaves["x"], leaves["fc_w"], leaves["fc_b"])), leaves["proj_w"], leaves["proj_b"])
    (y * ref["g"]).sum().backward()
    grads = {name: [res["grads"][name] for res in ranks] for name in ("fc_w", "fc_b", "proj_w", "proj_b")}
    sharded = {
        "fc_w": torch.cat(grads["fc_w"], dim=0) if None not in grads["fc_w"] else None,
        "fc_b": torch.cat(grads["fc_b"], dim=0) if None not in grads["fc_b"] else None,
        "proj_w": torch.cat(grads["proj_w"], dim=1) if None not in grads["proj_w"] else None,
    }
    activation = BATCH * T * H * 8
    return [
        compare("y on every rank", [res["y"] for res in ranks], [y.detach()] * P).line,
        compare("dL/dx on every rank", [res["grad_x"] for res in ranks], [leaves["x"].grad] * P).line,
        compare(
            "dL/d(fc W, fc b, proj W), the ranks' slices side by side",
            sharded,
            {name: leaves[name].grad for name in sharded},
        ).line,
        compare("dL/d(proj b) on every rank", grads["proj_b"], [leaves["proj_b"].grad] * P).line,
        calls_line(
            f"forward, every rank: one all-reduce of [B, T, H] ({activation} bytes), nothing else",
            [res["forward"] for res in ranks],
            [["allreduce", activation]],
        ),
        calls_line(
            f"backward, every rank: one all-reduce of [B, T, H] ({activation} bytes), nothing else",
            [res["backward"] for res in ranks],
            [["allreduce", activation]],
        ),
    ]


# ------------------------------------------------------------------------------ vocabulary-parallel cross-entropy


def ce_problem(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V], N = BATCH * T, with rows whose logits are near 1000 on one rank's columns or everywhere;
    targets: [N], spread over every rank's columns."""
    gen = torch.Generator().manual_seed(seed)
    N, k = BATCH * T, V // P
    logits = 3 * _randn(gen, N, V)
    logits[0, 2 * k : 3 * k] += 1000.0  # row 0: rank 2's columns dwarf the others
    logits[1] += 1000.0  # row 1: every logit near 1000 (exp overflows unless shifted)
    logits[2, :k] -= 1000.0  # row 2: its target's columns (rank 0) far below the rest
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[:P] = torch.tensor([2 * k + 1, V - 1, 3, k])  # rows 0-3: targets on ranks 2, 3, 0, 1
    return logits, targets


def run_vocab_ce(loss_fn) -> dict:
    """Rank code: rank r holds the logits' columns [r V/P, (r+1) V/P), i.e. vocabulary ids of that range."""
    r, k = dist.get_rank(), V // P
    logits, targets = ce_problem()
    z = logits[:, r * k : (r + 1) * k].clone().requires_grad_()  # [N, V/P]
    with probe.recording(keep_sent_data=False) as forward_calls:
        loss = loss_fn.apply(z, targets.clone(), r * k)
    with probe.recording(keep_sent_data=False) as backward_calls:
        loss.backward()
    return {"loss": loss.detach(), "grad": z.grad, "forward": _calls(forward_calls), "backward": _calls(backward_calls)}


def collect_vocab_ce(loss_fn) -> dict:
    return {"ranks": list(parlab.launch(run_vocab_ce, P, loss_fn, **LAUNCH))}


def judge_vocab_ce(data) -> list[str]:
    ranks, (logits, targets) = data["ranks"], ce_problem()
    logits = logits.requires_grad_()
    loss = F.cross_entropy(logits, targets)  # the mean over the N rows
    loss.backward()
    grads = [res["grad"] for res in ranks]
    grad = torch.cat(grads, dim=-1) if None not in grads else None
    limit = P * 2 * BATCH * T * 8  # bytes: 2 numbers per row from each rank, as seen by any one call
    wrong = []
    for r, res in enumerate(ranks):
        calls = res["forward"]
        if len(calls) != 1 or calls[0][1] > limit:
            shown = ", ".join(f"{op} of {n} bytes" for op, n in calls[:3]) or "nothing"
            wrong.append(f"rank {r} made {shown}")
    verdict = "PASS" if not wrong else f"{wrong[0]}: FAIL"
    return [
        compare("loss on every rank", [res["loss"] for res in ranks], [loss.detach()] * P).line,
        compare("dL/dlogits, the ranks' columns side by side", grad, logits.grad).line,
        f"forward, every rank: one call into torch.distributed, at most 2 numbers per row from each rank: {verdict}",
        calls_line("backward, every rank: no communication", [res["backward"] for res in ranks], []),
    ]


# ---------------------------------------------------------------------------------------- prediction: a layer


def run_layer() -> int:
    """Rank code: one forward and backward of a Megatron transformer layer (parlab.schemes.tensor_parallel); the bytes
    this rank handed to all-reduces."""
    full = build_model(LAYER_CFG, seed=0)
    block = TensorParallelBlock(full.blocks[0], 0)  # rank r keeps its heads and FFN units
    gen = torch.Generator().manual_seed(4)
    x = _randn(gen, BATCH, T, H).requires_grad_()
    g = _randn(gen, BATCH, T, H)
    with probe.recording(keep_sent_data=False) as calls:
        (block(x) * g).sum().backward()
    return probe.total_bytes(calls, "allreduce")


def layer_theory() -> dict[str, float]:
    """The library's theory of one layer's all-reduces (parlab.schemes.tensor_parallel), and a ring's share of them on
    the wire (lesson 00)."""
    items = allreduce_theory(LAYER_CFG, BATCH)
    payload = sum(items[name] for name in PER_LAYER_ITEMS) // LAYER_CFG.layers
    return {"payload": payload, "wire": 2 * (P - 1) / P * payload}


def plain(value) -> float | str:
    """A prediction as plain data for the grader: a float, or (what cannot be one) a short text."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_layer_bytes(predicted: dict) -> dict:
    measured = list(parlab.launch(run_layer, P, **LAUNCH))
    return {"predicted": {k: plain(predicted.get(k)) for k in ("payload_bytes", "wire_bytes")}, "measured": measured}


def judge_layer_bytes(data) -> list[str]:
    theory, predicted, measured = layer_theory(), data["predicted"], data["measured"]
    lines = prediction_lines(
        "all-reduce payload per rank, one layer, one step", predicted["payload_bytes"], theory["payload"], measured[0]
    )
    same = all(m == measured[0] for m in measured)
    lines.append(f"every rank handed the same payload to its all-reduces: {'PASS' if same else 'FAIL'}")
    lines += prediction_lines(
        "ring all-reduce bytes sent per rank, one layer, one step", predicted["wire_bytes"], theory["wire"]
    )
    return lines
