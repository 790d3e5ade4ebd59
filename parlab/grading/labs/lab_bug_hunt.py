"""The bug hunt's checks: six broken pieces of distributed training code, each run on live ranks and compared
with one device (float64), with what the ranks communicated watched at the process group or on parlab's trace.

Every rank function here is the working surroundings of one small function from the notebook (the student's):
the model, the data, the single-device reference and the verdicts live here, the code under suspicion in the
notebook's ANSWER cells. The code under suspicion is written for the labs' own model (parlab.core.lab_model) or a
variant the library lacks: data parallelism on the lab model, Megatron's f and g around its SwiGLU MLP, a zigzag
split that also hands out each token's RoPE position, ZeRO on a lab model whose size no rank count divides, 1F1B
over the lab model's blocks, and a ring-attention forward with grouped K/V heads. The library's own versions do
not fit, and an answer that calls them fails (LIBRARY, parlab/grading/labs/guard.py).

The sizes of every part and the shared helpers are in lab_bug_hunt_setup.py; parts 5 and 6 (point-to-point code)
are at the end of this file.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core import comm, probe
from parlab.core.check import check_equal, compare
from parlab.core.lab_model import LabModel, apply_rope, build_lab_model, gqa_attention, lab_batches, lab_loss, rms_norm
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab_bug_hunt_setup import (
    B_DP,
    B_ZERO,
    BATCH,
    DP_CFG,
    HD,
    HEADS,
    KV_HEADS,
    LAUNCH,
    P_PREDICT,
    PIPE_B,
    PIPE_CFG,
    PIPE_M,
    PIPELINE_LAUNCH,
    RING_C,
    T_TP,
    TP_CFG,
    ZERO_CFG,
    ZERO_LR,
    ZERO_STEPS,
    ZIGZAG_T,
    M,
    P,
    _grads,
    _no_error,
    _randn,
    adam_step,
    attention_problem,
)
from parlab.schemes.sequence.ring_attention import RingAttention, ring_attention

# What no answer may call (parlab/grading/labs/guard.py): the library's implementations of the six schemes the bugs
# are about, and the lesson helpers that hold the same code. The handed-out pieces live in this lab's own modules.
LIBRARY = (
    "schemes/data_parallel.py",
    "schemes/tensor_parallel.py",
    "schemes/sequence/",
    "schemes/zero/",
    "schemes/pipeline/",
    "lessons/data_parallel.py",
    "lessons/tensor_parallel.py",
    "lessons/sequence_parallel.py",
    "lessons/zero.py",
    "lessons/pipeline.py",
)

STRUCTURAL = {
    "dp_accumulation": "the lab model on 4 ranks, 2 micro-batches each: every rank ends with one device's gradient "
    "of the global batch; the bytes each rank all-reduces in one step equal one copy of the gradients; no other "
    "collective; no call into parlab's data parallelism",
    "tp_backward": "the lab model's MLP sublayer (RMSNorm, SwiGLU without biases, residual) with Megatron's f and g on "
    "4 ranks: y, dL/dx, the norm's and every projection's gradient match one device; the bytes each rank "
    "communicates in forward and in backward equal one [B, T, H] each; no call into parlab's tensor parallelism",
    "zigzag_padding": "for T = 16 and T = 19 on 4 ranks, grouped K/V heads and RoPE: each rank's zigzag block has "
    "the theory's number of tokens and its real tokens' global positions; the library's ring attention on the "
    "rotated blocks gives one device's causal attention and its gradients; no call into parlab's sequence code",
    "zero_padding": "3 Adam steps of a lab model of Psi = 678 parameters (not divisible by 4) on 4 ranks: every "
    "parameter matches one device; the state elements each rank holds and the bytes it reduce-scatters and "
    "all-gathers per step equal the theory's (equal shards, nothing replicated); no all-reduce; no call into "
    "parlab's ZeRO",
    "zero_sizes": "predictions for Psi = 678 on 7 ranks: the elements the handed-out step never updates, the "
    "shard size and the padding of a correct step (exact)",
    "pipeline_deadlock": "1F1B over the lab model's 4 blocks on 4 stages finishes (a hang fails within seconds), "
    "with one device's loss and every stage's gradients; every steady-state exchange makes one send and one receive "
    "through parlab.core.comm, both in flight at once (posted before either is waited for): a fix that orders "
    "them by rank parity fails here; no call into parlab's pipeline code",
    "ring_lse": "the library's ring-attention backward on the forward's (out, lse), grouped K/V heads: out and dq, "
    "dk, dv match one device's causal attention; the forward sends P-1 K/V blocks of the K/V heads only per rank; "
    "no call into parlab's sequence code",
}


def zero_sizes_theory() -> dict[str, int]:
    """THEORY of the prediction: for Psi on P_PREDICT ranks, the elements the handed-out step never updates (those
    past P floor(Psi/P)), the shard of a correct step (ceil(Psi/P)) and the padding it reduce-scatters."""
    psi = sum(p.numel() for p in build_lab_model(ZERO_CFG).parameters())
    shard = math.ceil(psi / P_PREDICT)
    return {"frozen": psi % P_PREDICT, "shard": shard, "padding": P_PREDICT * shard - psi}


# The predictions' theory, one function per PREDICT cell: what its judge scores against.
THEORY = {"zero_sizes": zero_sizes_theory}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def _library_line(part: str, called) -> str:
    return library_line(part, called, "the library's implementation of the scheme")


# --------------------------------------------------------------------------- part 1: data parallel, accumulation


def dp_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of token ids: x, y [B_DP, T] (y is x shifted by one)."""
    x, y = lab_batches(DP_CFG, B_DP, 1, seed=11)[0]
    return x.to(parlab.device()), y.to(parlab.device())


def run_dp(train_step) -> dict:
    """Rank code: rank r's rows of the batch through `train_step` (your code), the process group watched."""
    r = dist.get_rank()
    model = build_lab_model(DP_CFG, seed=10).to(parlab.device())  # the same weights on every rank
    x, y = dp_data()
    b = B_DP // P
    with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as called:
        train_step(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b], M)  # rows [r b, (r+1) b)
    return {"grads": _grads(model), "calls": calls, "library": called}


def collect_dp_accumulation(train_step) -> dict:
    return {"ranks": list(parlab.launch(run_dp, P, train_step, **LAUNCH))}


def judge_dp_accumulation(data) -> list[str]:
    model = build_lab_model(DP_CFG, seed=10)
    x, y = dp_data()
    lab_loss(model(x), y).backward()  # one device, the whole batch
    reference, psi = _grads(model), sum(p.numel() for p in model.parameters())
    ranks = data["ranks"]
    lines = [compare(f"rank {r}: gradients after the step", ranks[r]["grads"], reference).line for r in range(P)]
    for r in range(P):
        calls = ranks[r]["calls"]
        reduced = probe.total_bytes(calls, "allreduce")
        others = len([c for c in calls if c["op"] != "allreduce"])
        lines.append(
            check_equal(f"rank {r}: bytes all-reduced in one step (M = {M} micro-batches)", reduced, psi * 8).line
        )
        lines.append(check_equal(f"rank {r}: calls of other collectives", others, 0).line)
    lines.append(_library_line("train_step", [c for res in ranks for c in res.get("library", ["(not recorded)"])]))
    return lines


# ---------------------------------------------------------------------- part 2: tensor parallel, Megatron's f, g


def tp_problem() -> dict[str, torch.Tensor]:
    """The lab model's MLP sublayer and data: x [B, T, H], the RMSNorm gain [H], gate and up [F, H], down [H, F]
    (block 0 of a small lab model, its gain moved off 1 and its weights scaled up from their initial N(0, 0.02^2),
    as a trained model's are: the MLP's share of dL/dx is then not lost beside the residual's), the output gradient
    G [B, T, H]."""
    block = build_lab_model(TP_CFG, seed=20).blocks[0]
    H, scale = TP_CFG.hidden, 10.0
    return {
        "x": _randn(BATCH, T_TP, H, seed=21),
        "norm": 1 + _randn(H, seed=22) / 4,
        "gate": block.mlp.gate.weight.detach().to(parlab.device()) * scale,
        "up": block.mlp.up.weight.detach().to(parlab.device()) * scale,
        "down": block.mlp.down.weight.detach().to(parlab.device()) * scale,
        "G": _randn(BATCH, T_TP, H, seed=26),
    }


def tp_swiglu(x, norm, gate, up, down, f, g):
    """The lab model's MLP sublayer on this rank's slices: x + g(down_r(silu(gate_r(n)) * up_r(n))), with
    n = f(rmsnorm(x))."""
    n = f.apply(rms_norm(x, norm, TP_CFG.eps))  # [B, T, H], replicated: f before the column-parallel gate and up
    h = F.silu(n @ gate.T) * (n @ up.T)  # [B, T, F/P]: this rank's SwiGLU units
    return x + g.apply(h @ down.T)  # [B, T, H]: the partial sums summed by g (row-parallel down), then the residual


def run_tp(f, g) -> dict:
    """Rank code: rank r holds the SwiGLU units [r k, (r+1) k), k = F/P: rows of gate and up, columns of down."""
    r, k = dist.get_rank(), TP_CFG.ffn // P
    full = tp_problem()
    mine = {
        "x": full["x"].clone(),  # replicated
        "norm": full["norm"].clone(),  # replicated
        "gate": full["gate"][r * k : (r + 1) * k].clone(),  # [k, H]
        "up": full["up"][r * k : (r + 1) * k].clone(),  # [k, H]
        "down": full["down"][:, r * k : (r + 1) * k].clone(),  # [H, k]
    }
    for t in mine.values():
        t.requires_grad_()
    with library_calls(LIBRARY) as called:
        with probe.recording(keep_sent_data=False) as forward_calls:
            y = tp_swiglu(*mine.values(), f, g)
        with probe.recording(keep_sent_data=False) as backward_calls:
            (y * full["G"]).sum().backward()
    grads = {name: t.grad for name, t in mine.items()}
    return {"y": y.detach(), "grads": grads, "forward": forward_calls, "backward": backward_calls, "library": called}


def tp_single_device() -> dict:
    full = {name: t.requires_grad_() for name, t in tp_problem().items() if name != "G"}
    n = rms_norm(full["x"], full["norm"], TP_CFG.eps)
    y = full["x"] + (F.silu(n @ full["gate"].T) * (n @ full["up"].T)) @ full["down"].T
    (y * tp_problem()["G"]).sum().backward()
    return {"y": y.detach(), "grads": {name: t.grad for name, t in full.items()}}


def collect_tp_backward(f, g) -> dict:
    return {"ranks": list(parlab.launch(run_tp, P, f, g, **LAUNCH))}


def judge_tp_backward(data) -> list[str]:
    ranks, ref = data["ranks"], tp_single_device()
    grads = [res["grads"] for res in ranks]
    gathered, error = _no_error(
        "gradients of the ranks' slices",
        lambda: {
            "gate": torch.cat([g["gate"] for g in grads], dim=0),  # the ranks' rows stacked: [F, H]
            "up": torch.cat([g["up"] for g in grads], dim=0),  # [F, H]
            "down": torch.cat([g["down"] for g in grads], dim=1),  # the ranks' columns side by side: [H, F]
            "norm": grads[0]["norm"],  # rank 0's
            "x": grads[0]["x"],
        },
    )
    if gathered is None:
        return error
    ratios = ", ".join(f"{name} {(gathered[name].norm() / ref['grads'][name].norm()).item():.3f}" for name in gathered)
    lines = [f"gradient norms / one device's: {ratios}"]  # information, not a verdict
    lines += [compare(f"rank {r}: y", ranks[r]["y"], ref["y"]).line for r in range(P)]
    for name, what in [
        ("gate", "dL/dW of gate, the ranks' rows stacked"),
        ("up", "dL/dW of up, the ranks' rows stacked"),
        ("down", "dL/dW of down, the ranks' columns side by side"),
    ]:
        lines.append(compare(what, gathered[name], ref["grads"][name]).line)
    for name, what in [("norm", "dL/d(RMSNorm gain)"), ("x", "dL/dx")]:
        theirs, ours = [g[name] for g in grads], [ref["grads"][name]] * P
        lines.append(compare(f"{what}, on every rank", theirs, ours).line)
    y_bytes = BATCH * T_TP * TP_CFG.hidden * 8
    for r in range(P):
        for phase in ("forward", "backward"):
            sent = sum(int(c["bytes"]) or 1 for c in ranks[r][phase])  # every call; a barrier counts one byte
            lines.append(check_equal(f"rank {r}: bytes communicated in {phase}", sent, y_bytes).line)
    lines.append(_library_line("Copy and Reduce", [c for res in ranks for c in res.get("library", ["(not recorded)"])]))
    return lines


# -------------------------------------------------------- part 3: zigzag with RoPE positions, T not divisible by 2P


def zigzag_unshard(blocks: list[torch.Tensor], T: int) -> torch.Tensor:
    """The ranks' zigzag blocks back in sequence order, cut to the T real tokens: [1, HEADS, T, HD].

    blocks[r] holds chunks r and 2P-1-r of the 2P chunks (its first half, then its second half)."""
    pieces: list[torch.Tensor | None] = [None] * (2 * len(blocks))
    for r, block in enumerate(blocks):
        pieces[r], pieces[2 * len(blocks) - 1 - r] = block.chunk(2, dim=-2)
    return torch.cat(pieces, dim=-2)[..., :T, :]


def run_zigzag(zigzag_shard) -> dict:
    """Rank code: for each T, every rank shards the whole q, k, v and G with `zigzag_shard` (your code), turns its
    q and k by the positions it returned (RoPE, the lab model's), runs the library's ring attention (zigzag layout,
    causal; each K/V head repeated for its query heads) on its block and backpropagates sum(out_r * G_r)."""
    r = dist.get_rank()
    out = {}
    for T in ZIGZAG_T:
        q, k, v, g = attention_problem(T, seed=30 + T)
        for t in (q, k, v):
            t.requires_grad_()
        with library_calls(LIBRARY) as called:
            (q_r, positions), (k_r, _), (v_r, _), (g_r, _) = (zigzag_shard(t, r, P) for t in (q, k, v, g))
        positions = torch.as_tensor(positions, device=q.device)
        q_r, k_r = apply_rope(q_r, positions), apply_rope(k_r, positions)  # each token turns by its global position
        group = HEADS // KV_HEADS
        k_r, v_r = k_r.repeat_interleave(group, dim=1), v_r.repeat_interleave(group, dim=1)  # [1, HEADS, 2c, HD]
        o_r = ring_attention(q_r, k_r, v_r, causal=True, layout="zigzag")
        (o_r * g_r).sum().backward()  # q.grad: this rank's part of dL/dq (summed over ranks)
        out[T] = {"out": o_r.detach(), "positions": positions, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        out[T]["library"] = called
    return out


def _summed(per_rank: list[dict]) -> list[torch.Tensor]:
    """dL/dq, dL/dk, dL/dv: the sum of the ranks' shares (each rank's backward reaches only its own tokens)."""
    return [sum(res[name] for res in per_rank) for name in ("dq", "dk", "dv")]


def collect_zigzag_padding(zigzag_shard) -> dict:
    return {"ranks": list(parlab.launch(run_zigzag, P, zigzag_shard, **LAUNCH))}


def _wrong_positions(ranks, T: int) -> str:
    """'' when every rank's block gives its real tokens their global positions, else the first rank that does not."""
    c = math.ceil(T / (2 * P))
    for r in range(P):
        expected = [t for i in (r, 2 * P - 1 - r) for t in range(i * c, (i + 1) * c)]
        got = [int(t) for t in ranks[r][T]["positions"].reshape(-1).tolist()]
        real = [i for i, t in enumerate(expected) if t < T]
        if len(got) != len(expected) or [got[i] for i in real] != [expected[i] for i in real]:
            return f"rank {r}: expected {[expected[i] for i in real]}, received {got}"
    return ""


def judge_zigzag_padding(data) -> list[str]:
    ranks, lines = data["ranks"], []
    for T in ZIGZAG_T:
        q, k, v, g = (t.requires_grad_() for t in attention_problem(T, seed=30 + T))
        positions = torch.arange(T)  # host: the reference on one device
        reference = gqa_attention(apply_rope(q, positions), apply_rope(k, positions), v)  # one device, causal
        (reference * g.detach()).sum().backward()
        c = math.ceil(T / (2 * P))
        lengths = [int(ranks[r][T]["out"].shape[-2]) for r in range(P)]
        lines.append(f"T={T}: tokens in each rank's block: {lengths}")  # information
        for r in range(P):
            lines.append(check_equal(f"T={T}: rank {r}: tokens in its block", lengths[r], 2 * c).line)
        wrong = _wrong_positions(ranks, T)
        verdict = "PASS" if not wrong else f"{wrong}: FAIL"
        lines.append(f"T={T}: every rank's real tokens at their global positions: {verdict}")
        merged, error = _no_error(
            f"T={T}: the blocks back in order", zigzag_unshard, [ranks[r][T]["out"] for r in range(P)], T
        )
        if merged is None:
            lines += error
        else:
            lines.append(compare(f"T={T}: attention output, blocks back in order", merged, reference.detach()).line)
        what = f"T={T}: dL/dq, dL/dk, dL/dv (each rank's share, summed)"
        grads, error = _no_error(what, _summed, [ranks[r][T] for r in range(P)])
        lines += error or [compare(what, grads, [q.grad, k.grad, v.grad]).line]
    called = [c for res in ranks for T in ZIGZAG_T for c in res[T].get("library", ["(not recorded)"])]
    lines.append(_library_line("zigzag_shard", called))
    return lines


# ----------------------------------------------------------------------------- part 4: ZeRO, Psi not divisible by P


def zero_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of token ids: x, y [B_ZERO, T]."""
    x, y = lab_batches(ZERO_CFG, B_ZERO, 1, seed=41)[0]
    return x.to(parlab.device()), y.to(parlab.device())


def flat_lab_model(seed: int = 40) -> tuple[LabModel, torch.Tensor, torch.Tensor]:
    """The lab model whose parameters and gradients are views of two flat buffers of Psi numbers (no padding), in
    named_parameters() order: flat_param (writing it writes the parameters) and flat_grad (backward adds into it)."""
    model = build_lab_model(ZERO_CFG, seed).to(parlab.device())
    psi = sum(p.numel() for p in model.parameters())
    flat_param = torch.zeros(psi, dtype=torch.float64, device=parlab.device())
    flat_grad = torch.zeros(psi, dtype=torch.float64, device=parlab.device())
    offset = 0
    for p in model.parameters():
        n = p.numel()
        flat_param[offset : offset + n] = p.detach().reshape(-1)
        p.data = flat_param[offset : offset + n].view_as(p)
        p.grad = flat_grad[offset : offset + n].view_as(p)
        offset += n
    return model, flat_param, flat_grad


def run_zero(zero_update) -> dict:
    """Rank code: ZERO_STEPS steps of ZeRO (stage 2's communication) with `zero_update` (your code), each rank on
    its rows of the batch; the last step's calls into torch.distributed are recorded."""
    r = dist.get_rank()
    model, flat_param, flat_grad = flat_lab_model()
    x, y = zero_data()
    b = B_ZERO // P
    state: dict = {}  # this rank's optimizer state, kept by zero_update from step to step
    called: list[str] = []
    for step in range(1, ZERO_STEPS + 1):
        flat_grad.zero_()
        lab_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()  # flat_grad: my rows' gradient
        with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as seen:
            zero_update(flat_param, flat_grad, state, step)
        called += seen
    held = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "held": held, "calls": calls, "library": called}


def zero_single_device() -> dict[str, torch.Tensor]:
    """Adam (the setup's adam_step, torch's arithmetic) on one device, on the whole batch."""
    model, flat_param, flat_grad = flat_lab_model()
    x, y = zero_data()
    master, m, v = flat_param.clone(), torch.zeros_like(flat_param), torch.zeros_like(flat_param)
    for step in range(1, ZERO_STEPS + 1):
        flat_grad.zero_()
        lab_loss(model(x), y).backward()
        adam_step(master, flat_grad, m, v, step, ZERO_LR)
        flat_param.copy_(master)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def collect_zero_padding(zero_update) -> dict:
    return {"ranks": list(parlab.launch(run_zero, P, zero_update, **LAUNCH))}


def _unchanged(params: dict, initial: dict, reference: dict) -> str:
    """ "head.weight 2 of 174" for the parameters with elements still at their initial value that one device does
    change (information: an embedding row no token of the batch uses stays where it was on one device too)."""
    found = []
    for name, start in initial.items():
        mine = params.get(name)
        if isinstance(mine, torch.Tensor) and mine.shape == start.shape:
            if same := int(((mine == start) & (reference[name] != start)).sum()):
                found.append(f"{name} {same} of {start.numel()}")
    return ", ".join(found) or "none"


def judge_zero_padding(data) -> list[str]:
    ranks, reference = data["ranks"], zero_single_device()
    psi = sum(t.numel() for t in reference.values())
    S = math.ceil(psi / P)
    initial = {n: p.detach() for n, p in flat_lab_model()[0].named_parameters()}
    unchanged = _unchanged(ranks[0]["params"], initial, reference)
    lines = [f"rank 0: elements still at their initial value that one device updates: {unchanged}"]
    lines += [
        compare(f"rank {r}: parameters after {ZERO_STEPS} steps", ranks[r]["params"], reference).line for r in range(P)
    ]
    for r in range(P):
        calls = ranks[r]["calls"]
        lines += [
            check_equal(f"rank {r}: optimizer state elements held (master, m, v)", ranks[r]["held"], 3 * S).line,
            check_equal(
                f"rank {r}: bytes reduce-scattered into its gradient shard",
                probe.total_bytes(calls, "reduce_scatter_single"),
                S * 8,
            ).line,
            check_equal(
                f"rank {r}: bytes of the all-gathered parameters",
                probe.total_bytes(calls, "all_gather_single"),
                P * S * 8,
            ).line,
            check_equal(f"rank {r}: all-reduces", sum(c["op"] == "allreduce" for c in calls), 0).line,
        ]
    lines.append(_library_line("zero_update", [c for res in ranks for c in res.get("library", ["(not recorded)"])]))
    return lines


def collect_zero_sizes(predictions: dict) -> dict:
    """The predictions as plain data (numbers as floats; anything else as its text, which fails)."""
    out = {}
    for name in ("frozen", "shard", "padding"):
        value = predictions.get(name) if isinstance(predictions, dict) else None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        out[name] = value if isinstance(value, (int, float)) else str(value)[:40]
    return out


def judge_zero_sizes(data) -> list[str]:
    theory = zero_sizes_theory()
    psi = sum(p.numel() for p in build_lab_model(ZERO_CFG).parameters())
    labels = {
        "frozen": f"elements of flat_param the handed-out step never changes (Psi = {psi}, P = {P_PREDICT})",
        "shard": f"elements of each rank's master shard in a correct step (P = {P_PREDICT})",
        "padding": f"elements beyond Psi in the tensor a correct step reduce-scatters (P = {P_PREDICT})",
    }
    lines = []
    for name in ("frozen", "shard", "padding"):
        lines += prediction_lines(labels[name], data[name], theory[name], rtol=0)
    return lines


# ------------------------------------------------------------------ part 5: pipeline over the lab model's blocks


def pipe_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of token ids: x, y [PIPE_M * PIPE_B, T]; micro-batch i is rows [i b, (i+1) b)."""
    x, y = lab_batches(PIPE_CFG, PIPE_M * PIPE_B, 1, seed=51)[0]
    return x.to(parlab.device()), y.to(parlab.device())


def stage_parameters(model: LabModel, s: int) -> dict[str, torch.Tensor]:
    """Stage s's parameters, by the model's names: block s; the embedding on stage 0; the final norm and the head on
    the last stage."""
    mine = (f"blocks.{s}.",) + (("embed.",) if s == 0 else ()) + (("norm.", "head.") if s == P - 1 else ())
    return {name: p for name, p in model.named_parameters() if name.startswith(mine)}


def run_1f1b(send_forward_recv_backward, send_backward_recv_forward) -> dict:
    """Rank code: stage s = rank s runs Megatron's 1F1B (non-interleaved) over PIPE_M micro-batches of the lab
    model: stage s is its block s (stage 0 embeds the tokens; the last stage applies the final norm, the head and
    the loss). Every message is one micro-batch's [b, T, H].

    Warm-up and cool-down use plain blocking comm.send / comm.recv; the steady state uses your two exchange
    functions; each call of them is recorded (the traced sends and receives it made)."""
    s = dist.get_rank()
    first, last = s == 0, s == P - 1
    model = build_lab_model(PIPE_CFG, seed=50).to(parlab.device())  # every rank builds it; stage s uses its part
    positions = torch.arange(PIPE_CFG.seq_len, device=parlab.device())
    xs, ys = (t.chunk(PIPE_M) for t in pipe_data())  # PIPE_M micro-batches of [b, T] token ids
    shape = (PIPE_B, PIPE_CFG.seq_len, PIPE_CFG.hidden)
    fed, exchanges, loss_total = iter(range(PIPE_M)), [], 0.0
    held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, output) of micro-batches awaiting backward

    def recv_forward():
        if first:
            return xs[next(fed)]
        x = torch.empty(shape, dtype=torch.float64, device=parlab.device())
        comm.recv(x, s - 1)
        return x

    def forward(x):
        nonlocal loss_total
        h = model.embed(x) if first else x.requires_grad_()  # [b, T, H]
        out = model.blocks[s](h, positions)
        if last:  # the loss of micro-batch i, scaled so that the m losses add up to the batch's mean
            out = lab_loss(model.logits(out), ys[len(held) + done[0]]) / PIPE_M
            loss_total += out.item()
        held.append((x, out))
        return out

    def backward(grad):
        x, out = held.pop(0)
        torch.autograd.backward(out, grad)
        done[0] += 1
        return None if first else x.grad

    def recorded(fn, *args):  # one exchange: the peer it was for, and every traced call it made
        before = len(comm.trace_events())
        fn(*args)
        events = [(e.kind, e.peer, e.bytes, e.start, e.end) for e in comm.trace_events()[before:]]
        exchanges.append({"peer": args[-1], "events": events})

    done = [0]  # micro-batches whose backward is done (the last stage's targets are ys[i])
    warmup = min(P - s - 1, PIPE_M)
    with library_calls(LIBRARY) as called:
        for _ in range(warmup):
            out = forward(recv_forward())
            comm.send(out.detach(), s + 1)  # warm-up: forward only
        x = recv_forward() if PIPE_M > warmup else None
        for i in range(PIPE_M - warmup):  # steady state: one forward, one backward
            out = forward(x)
            grad = None
            if not last:  # send this output on, receive the gradient of the oldest output held
                grad = torch.empty(shape, dtype=torch.float64, device=parlab.device())
                recorded(send_forward_recv_backward, out.detach(), grad, s + 1)
            grad_x = backward(grad)
            if i == PIPE_M - warmup - 1:
                if not first:
                    comm.send(grad_x, s - 1)
            elif first:
                x = recv_forward()
            else:  # send the input's gradient back, receive the next micro-batch's input
                x = torch.empty(shape, dtype=torch.float64, device=parlab.device())
                recorded(send_backward_recv_forward, grad_x, x, s - 1)
        for _ in range(warmup):  # cool-down: backward only
            grad = torch.empty(shape, dtype=torch.float64, device=parlab.device())
            comm.recv(grad, s + 1)
            grad_x = backward(grad)
            if not first:
                comm.send(grad_x, s - 1)
    grads = {name: p.grad.detach().clone() for name, p in stage_parameters(model, s).items()}
    return {"grads": grads, "loss": loss_total, "exchanges": exchanges, "library": called}


def collect_pipeline_deadlock(send_forward_recv_backward, send_backward_recv_forward) -> dict:
    results = parlab.launch(run_1f1b, P, send_forward_recv_backward, send_backward_recv_forward, **PIPELINE_LAUNCH)
    return {"ranks": list(results)}


def _overlapped(exchange, peer: int) -> bool:
    """One send to `peer` and one receive from it, of one [b, T, H] each, the two in flight at the same time."""
    nbytes = PIPE_B * PIPE_CFG.seq_len * PIPE_CFG.hidden * 8
    sends = [e for e in exchange if e[0] == "send" and e[1] == peer and e[2] == nbytes]
    recvs = [e for e in exchange if e[0] == "recv" and e[1] == peer and e[2] == nbytes]
    if len(exchange) != 2 or len(sends) != 1 or len(recvs) != 1:
        return False
    (_, _, _, s0, s1), (_, _, _, r0, r1) = sends[0], recvs[0]
    s1, r1 = math.inf if s1 is None else s1, math.inf if r1 is None else r1  # never waited for: still in flight
    return s0 < r1 and r0 < s1


def judge_pipeline_deadlock(data) -> list[str]:
    ranks = data["ranks"]
    model = build_lab_model(PIPE_CFG, seed=50)
    x, y = pipe_data()
    loss = lab_loss(model(x), y)  # the mean over the batch: the m micro-batch losses / m add up to it
    loss.backward()
    lines = [compare("loss of the step (last stage)", ranks[P - 1]["loss"], loss.item()).line]
    for s in range(P):
        reference = {name: p.grad for name, p in stage_parameters(model, s).items()}
        lines.append(compare(f"stage {s}: its parameters' gradients", ranks[s]["grads"], reference).line)
    for s in range(P):
        steady = PIPE_M - min(P - s - 1, PIPE_M)  # steady-state steps of stage s
        expected = (steady if s < P - 1 else 0) + (steady - 1 if s > 0 else 0)  # calls of the two exchanges
        exchanges = ranks[s]["exchanges"]
        good = sum(_overlapped(e["events"], e["peer"]) for e in exchanges)
        what = (
            f"stage {s}: exchanges with their send and receive in flight at once "
            "(required: a link carries both directions at the same time)"
        )
        lines.append(check_equal(what, good, expected).line)
    called = [c for res in ranks for c in res.get("library", ["(not recorded)"])]
    lines.append(_library_line("the two exchanges", called))
    return lines


# ----------------------------------------------------------- part 6: ring attention's forward, grouped K/V, lse


def pass_on(block: torch.Tensor):
    """Start sending `block` to rank r+1 and receiving rank r-1's block into a new buffer: (incoming, works);
    comm.wait_all(works) before reading `incoming` (or reusing `block`)."""
    r = comm.group_rank()
    incoming = torch.empty_like(block)
    works = [comm.irecv(incoming, (r - 1) % P), comm.isend(block, (r + 1) % P)]
    return incoming, works


class _RingWithYourForward(torch.autograd.Function):
    """The library's ring attention (parlab.schemes.sequence.ring_attention.RingAttention), causal, contiguous layout,
    with your forward in place of its own: its backward gets the (q, k, v, out, lse) your forward returns, with each
    K/V head repeated for its query heads (the library's backward knows no grouped heads), and the K/V gradients of
    a group's query heads are summed back into their K/V head."""

    @staticmethod
    def forward(ctx, q, k, v, ring_forward):
        out, lse = ring_forward(q, k, v)
        group = q.shape[1] // k.shape[1]
        k_all, v_all = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, nq, c, hd]
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.causal, ctx.group, ctx.layout, ctx.label, ctx.kv_group = True, None, "contiguous", "", group
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = RingAttention.backward(ctx, dout)[:3]  # the library's: each tile's softmax from lse
        dk, dv = (t.unflatten(1, (-1, ctx.kv_group)).sum(2) for t in (dk, dv))  # [B, nkv, c, hd]
        return dq, dk, dv, None


def run_ring(ring_forward) -> dict:
    """Rank code: rank r holds tokens [r c, (r+1) c) of q, k, v; backpropagates sum(out_r * G_r)."""
    r, c = dist.get_rank(), RING_C
    q, k, v, g = (t[..., r * c : (r + 1) * c, :].clone() for t in attention_problem(P * c, seed=60))
    for t in (q, k, v):
        t.requires_grad_()
    with library_calls(LIBRARY) as called:
        out = _RingWithYourForward.apply(q, k, v, ring_forward)  # [1, HEADS, c, HD]
    sent = sum(e.bytes for e in comm.trace_events() if e.kind == "send")  # in forward, traced by parlab.core.comm
    (out * g).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "sent": sent, "library": called}


def collect_ring_lse(ring_forward) -> dict:
    return {"ranks": list(parlab.launch(run_ring, P, ring_forward, **LAUNCH))}


def judge_ring_lse(data) -> list[str]:
    ranks = data["ranks"]
    q, k, v, g = (t.requires_grad_() for t in attention_problem(P * RING_C, seed=60))
    reference = gqa_attention(q, k, v)  # one device, causal, grouped K/V heads
    (reference * g.detach()).sum().backward()
    lines = []
    for name, ref in [("out", reference.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)]:
        what = "attention output" if name == "out" else f"dL/d{name[1]}"
        side_by_side, error = _no_error(what, lambda n=name: torch.cat([ranks[r][n] for r in range(P)], dim=-2))
        lines += error or [compare(f"{what}, the ranks' blocks in order", side_by_side, ref).line]
    block = 2 * KV_HEADS * RING_C * HD * 8  # one K/V block [2, 1, KV_HEADS, c, HD]
    for r in range(P):
        sent = ranks[r]["sent"]
        what = f"rank {r}: bytes sent in forward (P-1 K/V blocks of the {KV_HEADS} K/V heads)"
        lines.append(check_equal(what, sent, (P - 1) * block).line)
    lines.append(_library_line("ring_forward", [c for res in ranks for c in res.get("library", ["(not recorded)"])]))
    return lines
