"""Lab 02's checks: Megatron's conjugate operators f and g; the lab model's SwiGLU MLP split over ranks from a fused
gate/up checkpoint; its grouped-query attention split by heads when there are fewer K/V heads than ranks; a
vocabulary-parallel cross-entropy in one collective; and a prediction of one lab-model layer's traffic.

Every check runs the student's code on P live ranks, each rank handed the same full problem (float64), and compares
with one device computing the whole thing (parlab.core.lab_model for the MLP and the attention). `probe.recording`
sees every call the code makes into torch.distributed (library calls included, with the group each ran on), in
forward, in backward and in the gradient sync separately. Calls into the library's own tensor-parallel code
(parlab/schemes/tensor_parallel.py and lesson 02's helpers, `LIBRARY`) are seen too (parlab/grading/labs/guard.py):
the lab asks for the student's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line

LAUNCH = {"timeout": 20, "echo": False}  # a hang (a collective some rank never calls) stops after 20 s
P, BATCH, T = 4, 2, 4  # ranks; every activation is [BATCH, T, ...]
H, OUT = 8, 16  # f and g: a column-parallel linear [B, T, H] -> [B, T, OUT]
V = 32  # the cross-entropy: logits [N, V] with N = BATCH * T rows
# Part 2: the lab model's SwiGLU MLP, H -> F -> H.
MLP_CFG = LabConfig(vocab_size=V, seq_len=T, hidden=16, heads=4, kv_heads=2, ffn=32, layers=1)
# Part 3: the lab model's attention, nq query heads, nkv < P key/value heads, head size hd = H / nq.
GQA_CASES = {
    "nq=4, nkv=2": LabConfig(vocab_size=V, seq_len=T, hidden=32, heads=4, kv_heads=2, ffn=32, layers=1),
    "nq=8, nkv=2": LabConfig(vocab_size=V, seq_len=T, hidden=32, heads=8, kv_heads=2, ffn=32, layers=1),
    "nq=4, nkv=1": LabConfig(vocab_size=V, seq_len=T, hidden=32, heads=4, kv_heads=1, ffn=32, layers=1),
}
FIRST_POSITION = 5  # part 3's tokens are positions 5 .. 5 + T - 1 of their sequence (RoPE rotates by these)
# The prediction: one layer of the lab model on P ranks, B = LAYER_BATCH sequences of LAYER_CFG.seq_len tokens.
LAYER_CFG = LabConfig(vocab_size=64, seq_len=8, hidden=64, heads=8, kv_heads=2, ffn=128, layers=1)
LAYER_BATCH = 2
LIBRARY = ("schemes/tensor_parallel.py", "lessons/tensor_parallel.py", "lessons/tensor_parallel_memory.py")

STRUCTURAL = {
    "conjugates": "f: no communication in forward and exactly one all-reduce of dL/dx ([B, T, H]) in backward, "
    "autograd's incoming gradient left unchanged (the all-reduce works on a copy); g: exactly one all-reduce of its "
    "input in forward and no communication in backward (seen at the process group, library calls included); the "
    "column-parallel layer built on f gives one device's dL/dx on every rank; no call into the library's f and g",
    "swiglu": "from the fused [gate; up] checkpoint every rank is handed: y and dL/dx on every rank equal one "
    "device's lab-model SwiGLU; each rank's gradient touches exactly the gate rows, up rows and down columns of one "
    "set of F/P units (the same units in all three, disjoint over ranks), and the ranks' gradients sum to one "
    "device's; exactly one all-reduce of [B, T, H] in forward and one in backward; no call into the library",
    "gqa": "for nq=4/nkv=2, nq=8/nkv=2 and nq=4/nkv=1 on 4 ranks, tokens at global positions 5..8: y, dL/dx and "
    "the q and o gradient slices on every rank equal one device's lab-model attention; after sync_grads each rank's "
    "k and v gradients are the full gradients of the K/V head its query heads read; one all-reduce of [B, T, H] "
    "each way over all ranks; the sync all-reduces only over the ranks that share the K/V head, 2 hd H numbers in "
    "all (the first wrong rank, group or tensor named); no call into the library",
    "vocab_ce": "the loss from one call into torch.distributed in forward that moves at most 2 numbers per row "
    "from each rank (the [N, V] logits never travel, not even in pieces), none in backward; rows with logits "
    "near 1000 included (exp overflows there without a common shift); no call into the library's loss",
    "layer_bytes": "the predicted all-reduce payload per rank of one lab-model layer per step (including the K/V "
    "gradient sync that grouped-query attention needs when nkv < P) and the ring wire bytes of those all-reduces "
    "(each ring over its own group) against the grader's theory, within 1%",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)  # host: the seeded draw


def _on_device(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(parlab.device()) for name, t in data.items()}


def _calls(calls) -> list[list]:
    """A probe's records as [op, bytes] pairs (with the group's ranks when the probe recorded them)."""
    return [[str(c["op"]), int(c["bytes"]), *([list(c["group"])] if "group" in c else [])] for c in calls]


def _shown(calls: list[list], limit: int = 4) -> str:
    text = ", ".join(f"{c[0]} of {c[1]} bytes" + (f" over ranks {c[2]}" if len(c) > 2 else "") for c in calls[:limit])
    return (text or "nothing") + (" ..." if len(calls) > limit else "")


def calls_line(what: str, ranks_calls: list[list[list]], expected: list[list]) -> str:
    """One verdict line: every rank made exactly the calls `expected` ([op, bytes(, group)], in order); else the
    first rank that did not, what it made and what was expected."""
    wrong = [(r, calls) for r, calls in enumerate(ranks_calls) if [list(c) for c in calls] != expected]
    if not wrong:
        return f"{what}: PASS"
    r, calls = wrong[0]
    return f"{what}: rank {r} made {_shown(calls)}, expected {_shown(expected)}: FAIL"


def ranks_line(what: str, got: list, expected: list) -> str:
    """One verdict line for a value every rank returns: the first rank that differs from one device is named."""
    for r, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        verdict = compare(f"{what}: rank {r}", ours, theirs)
        if not verdict.passed:
            return verdict.line
    return compare(what, got, expected).line


def _library(ranks: list[dict]) -> list[str]:
    return sorted({name for res in ranks for name in res["library"]})


def _library_line(what: str, ranks: list[dict]) -> str:
    return library_line(what, _library(ranks), "the library's tensor-parallel code")


# ---------------------------------------------------------------------------------------- f and g (conjugates)


def conjugates_problem(seed: int = 0) -> dict[str, torch.Tensor]:
    """x: [B, T, H] (replicated), W: [OUT, H], G: [B, T, OUT] = dL/dy; z: [P, B, T, H], rank r's partial sum z[r]
    for g, and Gz: [B, T, H] = dL/d(g's output)."""
    gen = torch.Generator().manual_seed(seed)
    names_shapes = {"x": (BATCH, T, H), "w": (OUT, H), "g": (BATCH, T, OUT), "z": (P, BATCH, T, H), "gz": (BATCH, T, H)}
    return {name: _randn(gen, *shape) for name, shape in names_shapes.items()}


def run_conjugates(f, g) -> dict:
    """Rank code: f in front of a column-parallel linear (rank r: W's rows [r OUT/P, (r+1) OUT/P)), then g alone.
    A hook on f's output keeps the gradient autograd hands to f's backward, and a copy of it taken then."""
    r, k = dist.get_rank(), OUT // P
    data = _on_device(conjugates_problem())
    x = data["x"].clone().requires_grad_()  # [B, T, H], the same on every rank
    w_r = data["w"][r * k : (r + 1) * k].clone()  # [OUT/P, H]
    incoming = []  # (dL/d(f's output) as autograd passes it on, a copy taken when it arrived)
    with probe.recording(keep_sent_data=False) as f_forward, library_calls(LIBRARY) as called:
        xf = f(x)
    if isinstance(xf, torch.Tensor) and xf.requires_grad:
        xf.register_hook(lambda grad: incoming.append((grad, grad.detach().clone())))
    y_r = xf @ w_r.T  # [B, T, OUT/P]: rank r's output columns
    with probe.recording(keep_sent_data=False) as f_backward, library_calls(LIBRARY) as called_backward:
        (y_r * data["g"][..., r * k : (r + 1) * k]).sum().backward()
    z = data["z"][r].clone().requires_grad_()  # [B, T, H]: this rank's partial sum
    with probe.recording(keep_sent_data=False) as g_forward, library_calls(LIBRARY) as called_g:
        total = g(z)
    with probe.recording(keep_sent_data=False) as g_backward, library_calls(LIBRARY) as called_g_backward:
        (total * data["gz"]).sum().backward()
    changed = None  # None: f's backward was never reached
    if incoming:
        seen, copy = incoming[0]
        changed = float((seen.detach() - copy).abs().max())
    return {
        "y": y_r.detach(),
        "grad_x": x.grad,
        "total": total.detach(),
        "grad_z": z.grad,
        "incoming_changed": changed,
        "calls": {
            "f forward": _calls(f_forward),
            "f backward": _calls(f_backward),
            "g forward": _calls(g_forward),
            "g backward": _calls(g_backward),
        },
        "library": [*called, *called_backward, *called_g, *called_g_backward],
    }


def collect_conjugates(f, g) -> dict:
    return {"ranks": list(parlab.launch(run_conjugates, P, f, g, **LAUNCH))}


def _incoming_line(ranks: list[dict]) -> str:
    what = "f backward: autograd's incoming dL/d(f's output) left unchanged on every rank"
    for r, res in enumerate(ranks):
        change = res["incoming_changed"]
        if change is None:
            return f"{what}: rank {r}: f's backward was never reached (f's output needs autograd): FAIL"
        if change != 0.0:
            return (
                f"{what}: rank {r}: it was overwritten in place (max change {change:.2g}; expected unchanged: "
                "autograd may hand the same tensor to other nodes): FAIL"
            )
    return f"{what}: PASS"


def judge_conjugates(data) -> list[str]:
    ranks, ref = data["ranks"], conjugates_problem()  # host: the reference on one device
    x, w = ref["x"].clone().requires_grad_(), ref["w"]
    y = x @ w.T
    (y * ref["g"]).sum().backward()
    activation = BATCH * T * H * 8  # bytes of one [B, T, H] float64 tensor
    ys = torch.cat([res["y"] for res in ranks], dim=-1)
    return [
        compare("f, column-parallel y = x W^T: the ranks' columns side by side", ys, y.detach()).line,
        ranks_line("f backward: dL/dx on every rank", [res["grad_x"] for res in ranks], [x.grad] * P),
        calls_line("f forward, every rank: no communication", [res["calls"]["f forward"] for res in ranks], []),
        calls_line(
            f"f backward, every rank: one all-reduce of dL/dx ({activation} bytes), nothing else",
            [res["calls"]["f backward"] for res in ranks],
            [["allreduce", activation]],
        ),
        _incoming_line(ranks),
        ranks_line("g: the sum of the ranks' z on every rank", [res["total"] for res in ranks], [ref["z"].sum(0)] * P),
        ranks_line("g backward: dL/dz on every rank", [res["grad_z"] for res in ranks], [ref["gz"]] * P),
        calls_line(
            f"g forward, every rank: one all-reduce of z ({activation} bytes), nothing else",
            [res["calls"]["g forward"] for res in ranks],
            [["allreduce", activation]],
        ),
        calls_line("g backward, every rank: no communication", [res["calls"]["g backward"] for res in ranks], []),
        _library_line("f and g", ranks),
    ]


# ------------------------------------------------------------------------------- the lab model's SwiGLU MLP


def swiglu_problem(seed: int = 2) -> dict[str, torch.Tensor]:
    """The lab model's first MLP (parlab.core.lab_model.SwiGLU, H -> F -> H, no biases) as a fused checkpoint stores
    it: gate_up [2F, H] = gate.weight [F, H] stacked on up.weight [F, H] (rows F.. are up's), down [H, F]. x: [B, T, H]
    and G = dL/dy: [B, T, H]."""
    mlp = build_lab_model(MLP_CFG, seed).blocks[0].mlp
    gen = torch.Generator().manual_seed(seed + 10)
    return {
        "gate_up": torch.cat([mlp.gate.weight, mlp.up.weight]).detach(),  # [2F, H]
        "down": mlp.down.weight.detach().clone(),  # [H, F]
        "x": _randn(gen, BATCH, T, MLP_CFG.hidden),
        "g": _randn(gen, BATCH, T, MLP_CFG.hidden),
    }


def run_swiglu(swiglu) -> dict:
    """Rank code: every rank is handed the whole fused checkpoint (as leaves: what this rank's slices of it receive
    in backward shows which units it used) and the whole x; it returns y [B, T, H]."""
    data = _on_device(swiglu_problem())
    x = data["x"].clone().requires_grad_()
    gate_up, down = data["gate_up"].clone().requires_grad_(), data["down"].clone().requires_grad_()
    with probe.recording(keep_sent_data=False) as forward_calls, library_calls(LIBRARY) as called:
        y = swiglu(x, gate_up, down)
    with probe.recording(keep_sent_data=False) as backward_calls, library_calls(LIBRARY) as called_backward:
        (y * data["g"]).sum().backward()
    return {
        "y": y.detach(),
        "grad_x": x.grad,
        "grad_gate_up": gate_up.grad,
        "grad_down": down.grad,
        "forward": _calls(forward_calls),
        "backward": _calls(backward_calls),
        "library": [*called, *called_backward],
    }


def collect_swiglu(swiglu) -> dict:
    return {"ranks": list(parlab.launch(run_swiglu, P, swiglu, **LAUNCH))}


def _units(index: torch.Tensor) -> str:
    """A set of unit numbers as ranges: '0-7, 16-23'."""
    values, parts = index.tolist(), []
    for v in values:
        if parts and parts[-1][1] == v - 1:
            parts[-1][1] = v
        else:
            parts.append([v, v])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts) or "none"


def _units_line(ranks: list[dict]) -> str:
    """Each rank's gradient touches the gate rows, up rows and down columns of the same F/P units, disjoint."""
    what = "each rank computes with the gate rows, up rows and down columns of one set of F/P units, disjoint"
    F_ = MLP_CFG.ffn
    owner = torch.full((F_,), -1)  # host: the grader's bookkeeping of which rank used each unit
    for r, res in enumerate(ranks):
        if res["grad_gate_up"] is None or res["grad_down"] is None:
            return f"{what}: rank {r}: no gradient reached the checkpoint's weights: FAIL"
        rows = res["grad_gate_up"].abs().sum(dim=1) != 0  # [2F]: the fused rows this rank's result depends on
        gate, up = rows[:F_].nonzero().flatten(), rows[F_:].nonzero().flatten()
        down = (res["grad_down"].abs().sum(dim=0) != 0).nonzero().flatten()
        if not (torch.equal(gate, up) and torch.equal(gate, down)):
            return (
                f"{what}: rank {r} used gate units {_units(gate)}, up units {_units(up)}, down units {_units(down)} "
                "(expected the same units in all three): FAIL"
            )
        if len(gate) != F_ // P:
            return f"{what}: rank {r} used {len(gate)} units ({_units(gate)}), expected F/P = {F_ // P}: FAIL"
        taken = gate[owner[gate] >= 0]
        if len(taken):
            return f"{what}: rank {r} used units {_units(taken)}, which rank {int(owner[taken[0]])} used too: FAIL"
        owner[gate] = r
    return f"{what}: PASS"


def judge_swiglu(data) -> list[str]:
    ranks, ref = data["ranks"], swiglu_problem()  # host: the reference on one device
    x = ref["x"].clone().requires_grad_()
    gate_up, down = ref["gate_up"].clone().requires_grad_(), ref["down"].clone().requires_grad_()
    gate, up = gate_up.chunk(2)
    y = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)  # the lab model's SwiGLU
    (y * ref["g"]).sum().backward()
    grads = {"gate_up": [res["grad_gate_up"] for res in ranks], "down": [res["grad_down"] for res in ranks]}
    summed = {name: sum(g) if None not in g else None for name, g in grads.items()}
    activation = BATCH * T * MLP_CFG.hidden * 8
    return [
        ranks_line("y on every rank", [res["y"] for res in ranks], [y.detach()] * P),
        ranks_line("dL/dx on every rank", [res["grad_x"] for res in ranks], [x.grad] * P),
        _units_line(ranks),
        compare(
            "dL/d(gate_up), dL/d(down): the ranks' gradients summed",
            summed,
            {"gate_up": gate_up.grad, "down": down.grad},
        ).line,
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
        _library_line("the SwiGLU MLP", ranks),
    ]


# ----------------------------------------------------------------------- grouped-query attention, nkv < P


def gqa_problem(cfg: LabConfig, seed: int = 3) -> dict[str, torch.Tensor]:
    """x: [B, T, H] and G = dL/dy: [B, T, H] for the attention of the lab model built from `cfg`."""
    gen = torch.Generator().manual_seed(seed)
    return {"x": _randn(gen, BATCH, T, cfg.hidden), "g": _randn(gen, BATCH, T, cfg.hidden)}


def positions() -> torch.Tensor:
    """The tokens' global positions: FIRST_POSITION .. FIRST_POSITION + T - 1."""
    return torch.arange(FIRST_POSITION, FIRST_POSITION + T, device=parlab.device())


def kv_head_of(cfg: LabConfig, rank: int) -> int:
    """The K/V head that rank `rank`'s query heads [rank nq/P, (rank+1) nq/P) read."""
    return (rank * cfg.heads // P) // cfg.group_size


def sharers(cfg: LabConfig, rank: int) -> list[int]:
    """The ranks that hold a copy of rank `rank`'s K/V head."""
    return [s for s in range(P) if kv_head_of(cfg, s) == kv_head_of(cfg, rank)]


def run_gqa(module_class) -> dict:
    """Rank code, for each case: the student's module built from the lab model's full attention (the same on every
    rank), its forward on the whole x at global positions, the backward of sum(y * G), then its gradient sync."""
    out = {}
    for name, cfg in GQA_CASES.items():
        full = build_lab_model(cfg, seed=3).blocks[0].attn.to(parlab.device())
        data = _on_device(gqa_problem(cfg))
        x = data["x"].clone().requires_grad_()
        with library_calls(LIBRARY) as called_init:
            module = module_class(full)
        with probe.recording(keep_sent_data=False, with_groups=True) as forward_calls, library_calls(LIBRARY) as called:
            y = module(x, positions())
        with probe.recording(keep_sent_data=False, with_groups=True) as backward_calls:
            (y * data["g"]).sum().backward()
        with probe.recording(keep_sent_data=False, with_groups=True) as sync_calls, library_calls(LIBRARY) as synced:
            module.sync_grads()
        out[name] = {
            "y": y.detach(),
            "grad_x": x.grad,
            "grads": {w: getattr(module, w).weight.grad for w in ("q", "k", "v", "o")},
            "forward": _calls(forward_calls),
            "backward": _calls(backward_calls),
            "sync": _calls(sync_calls),
            "library": [*called_init, *called, *synced],
        }
    return out


def collect_gqa(module_class) -> dict:
    return {"ranks": list(parlab.launch(run_gqa, P, module_class, **LAUNCH))}


def gqa_reference(cfg: LabConfig) -> dict:
    """One device: y, dL/dx and every weight's gradient of the lab model's attention at the same positions."""
    attn = build_lab_model(cfg, seed=3).blocks[0].attn
    data = gqa_problem(cfg)
    x = data["x"].clone().requires_grad_()
    y = attn(x, torch.arange(FIRST_POSITION, FIRST_POSITION + T))  # host: the reference on one device
    (y * data["g"]).sum().backward()
    return {"y": y.detach(), "grad_x": x.grad, "grads": {w: getattr(attn, w).weight.grad for w in ("q", "k", "v", "o")}}


def expected_grads(cfg: LabConfig, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of the full gradients: q rows and o columns of its query heads, k and v rows of the K/V
    head they read (the full gradient of that head: summed over every query head that reads it)."""
    hd, per_rank = cfg.head_size, cfg.heads // P
    mine = slice(rank * per_rank * hd, (rank + 1) * per_rank * hd)
    kv = slice(kv_head_of(cfg, rank) * hd, (kv_head_of(cfg, rank) + 1) * hd)
    return {"q": full["q"][mine], "k": full["k"][kv], "v": full["v"][kv], "o": full["o"][:, mine]}


def _grads_line(what: str, ranks: list[dict], expected: list[dict], names: tuple[str, ...]) -> str:
    """The first rank and weight whose gradient differs (shape or values), else one line over all."""
    for r, (res, exp) in enumerate(zip(ranks, expected, strict=True)):
        for w in names:
            verdict = compare(f"{what}: rank {r}, {w}.weight", res["grads"][w], exp[w])
            if not verdict.passed:
                return verdict.line
    return compare(
        what, [[res["grads"][w] for w in names] for res in ranks], [[e[w] for w in names] for e in expected]
    ).line


def _sync_line(name: str, cfg: LabConfig, ranks: list[dict]) -> str:
    """sync_grads: all-reduces only over the rank's sharers, 2 hd H float64 numbers in all."""
    hd, Hd = cfg.head_size, cfg.hidden
    expected_bytes = 2 * hd * Hd * 8
    what = f"{name}: sync_grads: all-reduces over the ranks sharing the K/V head only, {expected_bytes} bytes in all"
    for r, res in enumerate(ranks):
        group = sharers(cfg, r)
        for call in res["sync"]:
            if call[0] != "allreduce" or call[2] != group:
                return f"{what}: rank {r} made {_shown([call], 1)}, expected all-reduces over ranks {group}: FAIL"
        sent = sum(call[1] for call in res["sync"])
        if sent != expected_bytes:
            return f"{what}: rank {r} all-reduced {sent} bytes, expected {expected_bytes} (k and v of one head): FAIL"
    return f"{what}: PASS"


def judge_gqa(data) -> list[str]:
    lines = []
    for name, cfg in GQA_CASES.items():
        ranks = [res[name] for res in data["ranks"]]
        ref = gqa_reference(cfg)
        expected = [expected_grads(cfg, ref["grads"], r) for r in range(P)]
        activation = BATCH * T * cfg.hidden * 8
        everyone = list(range(P))
        lines += [
            ranks_line(f"{name}: y on every rank", [res["y"] for res in ranks], [ref["y"]] * P),
            ranks_line(f"{name}: dL/dx on every rank", [res["grad_x"] for res in ranks], [ref["grad_x"]] * P),
            _grads_line(f"{name}: dL/dW of q and o, this rank's heads", ranks, expected, ("q", "o")),
            _grads_line(f"{name}: dL/dW of k and v after sync_grads, the whole K/V head", ranks, expected, ("k", "v")),
            calls_line(
                f"{name}: forward, every rank: one all-reduce of [B, T, H] over all ranks, nothing else",
                [res["forward"] for res in ranks],
                [["allreduce", activation, everyone]],
            ),
            calls_line(
                f"{name}: backward, every rank: one all-reduce of [B, T, H] over all ranks, nothing else",
                [res["backward"] for res in ranks],
                [["allreduce", activation, everyone]],
            ),
            _sync_line(name, cfg, ranks),
        ]
    every = [{"library": [c for res in data["ranks"] for case in res.values() for c in case["library"]]}]
    lines.append(_library_line("the attention", every))
    return lines


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
    targets = torch.randint(0, V, (N,), generator=gen)  # host: the seeded draw
    targets[:P] = torch.tensor([2 * k + 1, V - 1, 3, k])  # host: rows 0-3's targets, on ranks 2, 3, 0, 1
    return logits, targets


def run_vocab_ce(loss_fn) -> dict:
    """Rank code: rank r holds the logits' columns [r V/P, (r+1) V/P), i.e. vocabulary ids of that range."""
    r, k = dist.get_rank(), V // P
    logits, targets = (t.to(parlab.device()) for t in ce_problem())
    z = logits[:, r * k : (r + 1) * k].clone().requires_grad_()  # [N, V/P]
    with probe.recording(keep_sent_data=False) as forward_calls, library_calls(LIBRARY) as called:
        loss = loss_fn.apply(z, targets.clone(), r * k)
    with probe.recording(keep_sent_data=False) as backward_calls, library_calls(LIBRARY) as called_backward:
        loss.backward()
    return {
        "loss": loss.detach(),
        "grad": z.grad,
        "forward": _calls(forward_calls),
        "backward": _calls(backward_calls),
        "library": [*called, *called_backward],
    }


def collect_vocab_ce(loss_fn) -> dict:
    return {"ranks": list(parlab.launch(run_vocab_ce, P, loss_fn, **LAUNCH))}


def judge_vocab_ce(data) -> list[str]:
    ranks, (logits, targets) = data["ranks"], ce_problem()  # host: the reference on one device
    logits = logits.requires_grad_()
    loss = F.cross_entropy(logits, targets)  # the mean over the N rows
    loss.backward()
    grads = [res["grad"] for res in ranks]
    grad = torch.cat(grads, dim=-1) if None not in grads else None
    limit = P * 2 * BATCH * T * 8  # bytes: 2 numbers per row from each rank, as seen by any one call
    what = "forward, every rank: one call into torch.distributed, at most 2 numbers per row from each rank"
    verdict = f"{what}: PASS"
    for r, res in enumerate(ranks):
        calls = res["forward"]
        if len(calls) != 1 or calls[0][1] > limit:
            verdict = f"{what}: rank {r} made {_shown(calls, 3)}, expected one call of at most {limit} bytes: FAIL"
            break
    return [
        ranks_line("loss on every rank", [res["loss"] for res in ranks], [loss.detach()] * P),
        compare("dL/dlogits, the ranks' columns side by side", grad, logits.grad).line,
        verdict,
        calls_line("backward, every rank: no communication", [res["backward"] for res in ranks], []),
        _library_line("the loss", ranks),
    ]


# ---------------------------------------------------------------------------------------- prediction: a layer


def layer_theory(cfg: LabConfig = LAYER_CFG, batch: int = LAYER_BATCH, ranks: int = P) -> dict[str, float]:
    """One lab-model layer on `ranks` ranks, one step (forward and backward), per rank, float64.

    Megatron's four all-reduces of an activation [B, T, H]: g behind attention and behind the MLP (forward), f in
    front of each (backward). The RMSNorm gains need nothing: their input and their gradient are the same on every
    rank. With nkv < P each K/V head lives on m = P / nkv ranks, each holding a partial gradient of its k and v
    weights ([hd, H] each): one more all-reduce of 2 hd H numbers, over those m ranks only. A ring all-reduce over
    n ranks sends 2 (n-1)/n of its payload (lesson 00)."""
    e = cfg.dtype_bytes
    activation = batch * cfg.seq_len * cfg.hidden * e
    m = max(ranks // cfg.kv_heads, 1)  # ranks that share one K/V head
    kv_sync = 2 * cfg.head_size * cfg.hidden * e if m > 1 else 0
    return {
        "payload_bytes": 4 * activation + kv_sync,
        "wire_bytes": 2 * (ranks - 1) / ranks * 4 * activation + 2 * (m - 1) / m * kv_sync,
    }


THEORY = {"layer_bytes": layer_theory}


def plain(value) -> float | str:
    """A prediction as plain data for the grader: a float, or (what cannot be one) a short text."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_layer_bytes(predicted: dict) -> dict:
    return {"predicted": {k: plain(predicted.get(k)) for k in ("payload_bytes", "wire_bytes")}}


def judge_layer_bytes(data) -> list[str]:
    theory, predicted = layer_theory(), data["predicted"]
    return [
        *prediction_lines(
            "all-reduce payload per rank, one layer, one step",
            predicted["payload_bytes"],
            theory["payload_bytes"],
            rtol=0.01,
        ),
        *prediction_lines(
            "ring all-reduce bytes sent per rank, one layer, one step",
            predicted["wire_bytes"],
            theory["wire_bytes"],
            rtol=0.01,
        ),
    ]
