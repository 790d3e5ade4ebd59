"""The bug hunt's checks: six broken pieces of distributed training code, each run on live ranks and compared
with one device (float64), with what the ranks communicated watched at the process group (parlab.core.probe).

Every rank function here is the working surroundings of one function from the notebook (the student's): the
model, the data, the single-device reference and the verdicts live here, the code under suspicion in the notebook's
ANSWER cells, written for the labs' own model (parlab.core.lab_model) or a variant the library lacks:

1. data parallelism with gradient accumulation, on documents padded to the sequence length;
2. Megatron's f and g around the lab model's SwiGLU MLP (RMSNorm, residual);
3. the next-token targets of a zigzag layout, each rank holding only its own block of token ids;
4. ZeRO for the lab model's matrices (padded shards, its RMSNorm gains replicated) with global-norm gradient
   clipping, and a prediction at Llama-3-8B scale;
5. a 1F1B loop over the lab model's blocks, for any number of micro-batches (lab_bug_hunt_pipeline.py);
6. a ring-attention forward for grouped K/V heads, under the library's backward (lab_bug_hunt_ring.py).

What the answers must not call (LIBRARY, parlab/grading/labs/guard.py), the sizes and the shared helpers are in
lab_bug_hunt_setup.py. Under the notebook's bug reports, this file says what is checked, never what is wrong: the
diagnosis is the student's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core import probe
from parlab.core.lab_model import LabModel, build_lab_model, lab_batches, lab_loss, rms_norm
from parlab.grading.labs import lab_bug_hunt_pipeline as pipeline_part
from parlab.grading.labs import lab_bug_hunt_ring as ring_part
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab_bug_hunt_setup import (
    B_DP,
    B_ZERO,
    BATCH,
    DP_CFG,
    DP_LENGTHS,
    IGNORE,
    LAUNCH,
    LIBRARY,
    MAX_NORM,
    PREDICT_CFG,
    PREDICT_N,
    PREDICT_NORMS,
    T_TP,
    TP_CFG,
    ZERO_CFG,
    ZERO_LR,
    ZERO_STEPS,
    ZIGZAG_T,
    ZZ_B,
    ZZ_CFG,
    M,
    P,
    _grads,
    _no_error,
    _randn,
    adam_step,
    clip_coefficient,
    first_wrong,
    library_verdict,
)

__all__ = ["LIBRARY", "PARTS", "STRUCTURAL", "THEORY", "run"]

PARTS = (pipeline_part, ring_part)  # the checks of parts 5 and 6 live there

STRUCTURAL = {
    "dp_tokens": "the lab model on 4 ranks, 2 micro-batches each, on documents padded with ignored targets (every "
    "rank and micro-batch with its own count of real targets): every "
    "rank's gradients equal one device's on the whole batch (the mean over its real targets); each rank "
    "communicates one copy of the gradients and at most 2P more numbers per step; no call into parlab's data "
    "parallelism",
    "tp_norm": "the lab model's MLP sublayer (RMSNorm, SwiGLU without biases, residual) with Megatron's f and g on "
    "4 ranks: y, dL/dx, every projection's gradient and the RMSNorm gain's gradient on every rank match one device; "
    "each rank communicates one [B, T, H] in forward and one in backward, nothing more; no call into parlab's "
    "tensor parallelism",
    "zigzag_targets": "for T = 16 and 24 on 4 ranks, each rank given only its zigzag block of token ids: every "
    "rank's targets equal one device's next tokens in the same layout (the sequence's last token ignored); each "
    "rank exchanges only with ranks r-1 and r+1, point to point, at most two token ids per sequence; no call into "
    "parlab's sequence code",
    "zero_clip": "3 Adam steps with the gradient clipped at a global norm, the lab model's matrices in padded flat "
    "ZeRO shards (642 numbers on 4 ranks) and its RMSNorm gains replicated: the norm each rank clipped by and every "
    "parameter equal one device's; each rank reduce-scatters its padded shard, all-gathers the parameters, "
    "all-reduces the gains' gradients and at most 2P more numbers, nothing else; no call into parlab's ZeRO",
    "clip_at_scale": "predictions for the fixed step on a Llama-3-8B-sized lab model on 96 ranks (shard and "
    "padding, exact) and the norm the handed-out step clips by (0.1%)",
    "pipeline_m": "the lab model's 4 blocks on 4 stages, m = 4 (one step), 3 and 2 micro-batches (two steps each, "
    "the loader going on into the next step): no hang (a hang fails within seconds, naming each rank's call), each "
    "step's loss and every stage's gradients equal one device's on that step's batch; every stage sends m activations "
    "forward and m gradients back per step, nothing else; no call into parlab's pipeline code",
    "ring_gqa": "a ring-attention forward of grouped K/V heads under the library's backward, for (nq, nkv) = (4, 4) "
    "and (6, 2): out and dq, dk, dv equal one device's causal attention; each rank sends P-1 K/V blocks of the nkv "
    "heads only in forward; no call into parlab's sequence code",
}


def clip_at_scale_theory() -> dict[str, float]:
    """THEORY of the prediction: the lab model at PREDICT_CFG on PREDICT_N ranks, its matrices flat and padded into
    equal shards: the shard each rank holds and the padding of the last one; and the norm the handed-out step clips
    by when the averaged gradient's matrices have norm a and its gains norm b."""
    c = PREDICT_CFG
    V, H, L, F_ = c["vocab"], c["hidden"], c["layers"], c["ffn"]
    hd = H // c["heads"]
    block = 2 * H * H + 2 * c["kv_heads"] * hd * H + 3 * F_ * H  # q and o, k and v, gate, up and down
    matrices = 2 * V * H + L * block  # the embedding and the untied head
    shard = math.ceil(matrices / PREDICT_N)
    a, b = PREDICT_NORMS["matrices"], PREDICT_NORMS["gains"]
    # The handed-out step's arithmetic on N ranks, the matrices' squares spread evenly over the shards (their sum a^2)
    shards = [a * a / PREDICT_N] * PREDICT_N
    squares = [part + b * b for part in shards]  # mine = [grad] + [g.grad for g in gains], summed, on each rank
    return {
        "shard": shard,
        "padding": PREDICT_N * shard - matrices,
        "handout_norm": math.sqrt(sum(squares)),  # after the all-reduce
    }


# The predictions' theory, one function per PREDICT cell: what its judge scores against.
THEORY = {"clip_at_scale": clip_at_scale_theory}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# The process-group methods (parlab.core.probe's "op") of each collective, whichever torch.distributed call made it.
_REDUCE_SCATTER = ("reduce_scatter_single", "reduce_scatter", "reduce_scatter_tensor_coalesced")
_ALL_GATHER = ("all_gather_single", "allgather", "allgather_into_tensor_coalesced")
_ALL_REDUCE = ("allreduce", "allreduce_coalesced")


def _summed(ops: tuple[str, ...]):
    """The bytes of one step's calls of these process-group methods: step {op: bytes} -> int."""
    return lambda step: sum(step.get(op, 0) for op in ops)


def _bytes_line(what: str, received: list, least: int, most: int) -> str:
    """One verdict over the ranks: each rank's bytes (or each of its steps' bytes, a list) in [least, most]; a FAIL
    names the first rank (and step) that is not."""
    bound = f"{least}" if least == most else f"from {least} to {most}"
    for r, got in enumerate(received):
        for step, value in enumerate(got if isinstance(got, list) else [got]):
            if not least <= value <= most:
                where = f"rank {r}, step {step + 1}" if isinstance(got, list) else f"rank {r}"
                return f"{what}: {where}: expected {bound}, received {value}: FAIL"
    return f"{what}: {bound} on every rank: PASS"


# --------------------------------------------------------------- part 1: data parallel, accumulation, padded documents


def dp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of token ids, x, y [B_DP, T]: document i of DP_LENGTHS[i] real targets, then padding (input
    0, target IGNORE: the loss leaves it out)."""
    x, y = (t.to(parlab.device()) for t in lab_batches(DP_CFG, B_DP, 1, seed=11)[0])
    for i, n in enumerate(DP_LENGTHS):
        x[i, n:], y[i, n:] = 0, IGNORE
    return x, y


def run_dp(train_step) -> dict:
    """Rank code: rank r's rows [r b, (r+1) b) of the global batch through `train_step` (your code), from the same
    weights on every rank, the process group watched."""
    r, b = dist.get_rank(), B_DP // P
    x, y = dp_batch()
    model = build_lab_model(DP_CFG, seed=10).to(parlab.device())  # the same weights on every rank
    with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as called:
        train_step(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b], M)
    return {"grads": _grads(model), "bytes": sum(int(c["bytes"]) for c in calls), "library": called}


def collect_dp_tokens(train_step) -> dict:
    return {"ranks": list(parlab.launch(run_dp, P, train_step, **LAUNCH))}


def judge_dp_tokens(data) -> list[str]:
    ranks = data["ranks"]
    model = build_lab_model(DP_CFG, seed=10)
    x, y = dp_batch()
    lab_loss(model(x), y).backward()  # one device, the whole batch: the mean over its real targets
    reference, psi = _grads(model), sum(p.numel() for p in model.parameters())
    expected = {f"rank {r}: {n}": g for r in range(P) for n, g in reference.items()}
    got = {f"rank {r}: {n}": g for r in range(P) for n, g in ranks[r]["grads"].items()}
    what = f"bytes each rank communicates in the step (one copy of the gradients, and at most {2 * P} numbers)"
    return [
        first_wrong("every rank's gradients after the step", got, expected),
        _bytes_line(what, [res["bytes"] for res in ranks], psi * 8, psi * 8 + 2 * P * 8),
        library_verdict("train_step", [c for res in ranks for c in res["library"]]),
    ]


# ---------------------------------------------------------------------- part 2: tensor parallel, Megatron's f, g


def tp_problem() -> dict[str, torch.Tensor]:
    """The lab model's MLP sublayer and data: x [B, T, H], the RMSNorm gain [H], gate and up [F, H], down [H, F]
    (block 0 of a small lab model, its gain moved off 1 and its weights scaled up from their initial N(0, 0.02^2),
    as a trained model's are), the output gradient G [B, T, H]."""
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


def run_tp(mlp_sublayer) -> dict:
    """Rank code: rank r holds the SwiGLU units [r k, (r+1) k), k = F/P: rows of gate and up, columns of down; x and
    the RMSNorm gain are replicated. Runs `mlp_sublayer` (your code) forward, then backward from sum(y * G)."""
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
            y = mlp_sublayer(*mine.values())
        with probe.recording(keep_sent_data=False) as backward_calls:
            (y * full["G"]).sum().backward()
    grads = {name: t.grad for name, t in mine.items()}
    return {
        "y": y.detach(),
        "grads": grads,
        "forward": sum(int(c["bytes"]) or 1 for c in forward_calls),  # every call; a barrier counts one byte
        "backward": sum(int(c["bytes"]) or 1 for c in backward_calls),
        "library": called,
    }


def tp_single_device() -> dict:
    full = {name: t.requires_grad_() for name, t in tp_problem().items() if name != "G"}
    n = rms_norm(full["x"], full["norm"], TP_CFG.eps)
    y = full["x"] + (F.silu(n @ full["gate"].T) * (n @ full["up"].T)) @ full["down"].T
    (y * tp_problem()["G"]).sum().backward()
    return {"y": y.detach(), "grads": {name: t.grad for name, t in full.items()}}


def collect_tp_norm(mlp_sublayer) -> dict:
    return {"ranks": list(parlab.launch(run_tp, P, mlp_sublayer, **LAUNCH))}


def judge_tp_norm(data) -> list[str]:
    ranks, ref = data["ranks"], tp_single_device()
    grads = [res["grads"] for res in ranks]
    lines = [first_wrong("y, on every rank", {f"rank {r}": ranks[r]["y"] for r in range(P)}, _every(ref["y"]))]
    gathered, error = _no_error(
        "gradients of the ranks' slices",
        lambda: {
            "gate, the ranks' rows stacked": torch.cat([g["gate"] for g in grads], dim=0),  # [F, H]
            "up, the ranks' rows stacked": torch.cat([g["up"] for g in grads], dim=0),  # [F, H]
            "down, the ranks' columns side by side": torch.cat([g["down"] for g in grads], dim=1),  # [H, F]
        },
    )
    if gathered is None:
        return lines + error
    expected = {
        "gate, the ranks' rows stacked": ref["grads"]["gate"],
        "up, the ranks' rows stacked": ref["grads"]["up"],
        "down, the ranks' columns side by side": ref["grads"]["down"],
    }
    lines.append(first_wrong("the projections' weight gradients", gathered, expected))
    for name, what in [("x", "dL/dx"), ("norm", "dL/d(RMSNorm gain)")]:
        got = {f"rank {r}": grads[r][name] for r in range(P)}
        lines.append(first_wrong(f"{what}, on every rank", got, _every(ref["grads"][name])))
    y_bytes = BATCH * T_TP * TP_CFG.hidden * 8  # one [B, T, H]
    for phase in ("forward", "backward"):
        what = f"bytes each rank communicates in {phase} (one [B, T, H])"
        lines.append(_bytes_line(what, [ranks[r][phase] for r in range(P)], y_bytes, y_bytes))
    called = [c for res in ranks for c in res["library"]]
    lines.append(library_verdict("mlp_sublayer", called))
    return lines


def _every(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"rank {r}": tensor for r in range(P)}


# ------------------------------------------------------------ part 3: the targets of a zigzag layout, sharded ids


def zigzag_block(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s zigzag block of a [B, T] tensor: chunks rank and 2P-1-rank of 2P chunks, side by side."""
    chunks = t.chunk(2 * P, dim=1)
    return torch.cat([chunks[rank], chunks[2 * P - 1 - rank]], dim=1)  # [B, 2c]


def zigzag_problem(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ZZ_B sequences of T token ids x [ZZ_B, T] (no id twice in a sequence: a wrong target never looks right), and
    their targets y: the next token, IGNORE for the last one."""
    gen = torch.Generator().manual_seed(30 + T)
    x = torch.stack([torch.randperm(ZZ_CFG.vocab_size, generator=gen)[:T] for _ in range(ZZ_B)])  # host: the draw
    x = x.to(parlab.device())
    y = torch.full_like(x, IGNORE)
    y[:, :-1] = x[:, 1:]
    return x, y


def run_zigzag(zigzag_targets) -> dict:
    """Rank code: for each T, rank r holds only its zigzag block x_r [B, 2c] of the token ids and asks
    `zigzag_targets` (your code) for their targets; its calls into torch.distributed are recorded."""
    r, out = dist.get_rank(), {}
    for T in ZIGZAG_T:
        x_r = zigzag_block(zigzag_problem(T)[0], r)
        with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as called:
            targets = zigzag_targets(x_r.clone())
        calls = [{"op": c["op"], "peer": int(c["peer"]), "bytes": int(c["bytes"])} for c in calls]
        out[T] = {"targets": targets, "calls": calls, "library": called}
    return out


def collect_zigzag_targets(zigzag_targets) -> dict:
    return {"ranks": list(parlab.launch(run_zigzag, P, zigzag_targets, **LAUNCH))}


def _wrong_target(ranks, T: int, y: torch.Tensor) -> str:
    """'' when every rank's targets equal one device's in its block, else the first wrong one."""
    for r in range(P):
        want, got = zigzag_block(y, r), ranks[r][T]["targets"]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return f"rank {r}: expected a tensor of shape {list(want.shape)}, received {_shape(got)}"
        wrong = (got.to(torch.int64) != want).nonzero()
        if len(wrong):
            b, i = (int(j) for j in wrong[0])
            return (
                f"rank {r}, sequence {b}, index {i} of its block: expected {int(want[b, i])}, received {int(got[b, i])}"
            )
    return ""


def _shape(value) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _stray_call(ranks, T: int) -> str:
    """'' when every rank only sends to and receives from ranks r-1 and r+1, at most 2 token ids per sequence."""
    most = 2 * ZZ_B * 8
    for r in range(P):
        calls = ranks[r][T]["calls"]
        for c in calls:
            if c["op"] not in ("send", "recv") or c["peer"] not in (r - 1, r + 1):
                peer = f" with rank {c['peer']}" if c["peer"] >= 0 else ""
                return f"rank {r}: expected sends and receives with ranks r-1, r+1 only, received {c['op']}{peer}"
        sent = sum(c["bytes"] for c in calls if c["op"] == "send")
        if sent > most:
            return f"rank {r}: expected at most {most} bytes sent, received {sent}"
    return ""


def _loss_with(targets: torch.Tensor, x: torch.Tensor) -> float:
    """The lab model's loss on x with these targets (a small model: information, the user's symptom)."""
    model = build_lab_model(ZZ_CFG, seed=31)
    with torch.no_grad():
        return lab_loss(model(x), targets).item()


def _unzigzag(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' [B, 2c] blocks back in sequence order: [B, T]."""
    pieces: list[torch.Tensor | None] = [None] * (2 * P)
    for r, block in enumerate(blocks):
        pieces[r], pieces[2 * P - 1 - r] = block.chunk(2, dim=1)
    return torch.cat(pieces, dim=1)


def judge_zigzag_targets(data) -> list[str]:
    ranks, lines = data["ranks"], []
    for T in ZIGZAG_T:
        x, y = zigzag_problem(T)
        in_order, _ = _no_error("", lambda t=T: _unzigzag([ranks[r][t]["targets"].to(torch.int64) for r in range(P)]))
        loss, _ = _no_error("", _loss_with, in_order, x)
        if loss is not None:  # information: the symptom the user saw
            lines.append(f"T={T}: the loss with the ranks' targets: {loss:.6f} (one device: {_loss_with(y, x):.6f})")
        wrong = _wrong_target(ranks, T, y)
        lines.append(f"T={T}: every rank's targets against one device's: {f'{wrong}: FAIL' if wrong else 'PASS'}")
        stray = _stray_call(ranks, T)
        what = f"T={T}: each rank exchanges with its neighbours only, at most two token ids per sequence"
        lines.append(f"{what}: {f'{stray}: FAIL' if stray else 'PASS'}")
    called = [c for res in ranks for T in ZIGZAG_T for c in res[T]["library"]]
    lines.append(library_verdict("zigzag_targets", called))
    return lines


# ---------------------------------------------------------- part 4: ZeRO with the gradient clipped at a global norm


def zero_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of token ids: x, y [B_ZERO, T]."""
    x, y = lab_batches(ZERO_CFG, B_ZERO, 1, seed=41)[0]
    return x.to(parlab.device()), y.to(parlab.device())


def flat_lab_model(seed: int = 40) -> tuple[LabModel, torch.Tensor, torch.Tensor, list[torch.nn.Parameter]]:
    """The lab model whose matrices (every 2-D parameter, in named_parameters() order) are views of two flat buffers
    of PSI_M numbers (no padding): flat_param (writing it writes the matrices) and flat_grad (backward adds into it);
    and its RMSNorm gains, [H] each, as they are (replicated on every rank, each with its own .grad)."""
    model = build_lab_model(ZERO_CFG, seed).to(parlab.device())
    matrices = [p for p in model.parameters() if p.dim() == 2]
    gains = [p for p in model.parameters() if p.dim() == 1]
    psi_m = sum(p.numel() for p in matrices)
    flat_param = torch.zeros(psi_m, dtype=torch.float64, device=parlab.device())
    flat_grad = torch.zeros(psi_m, dtype=torch.float64, device=parlab.device())
    offset = 0
    for p in matrices:
        n = p.numel()
        flat_param[offset : offset + n] = p.detach().reshape(-1)
        p.data = flat_param[offset : offset + n].view_as(p)
        p.grad = flat_grad[offset : offset + n].view_as(p)
        offset += n
    return model, flat_param, flat_grad, gains


def run_zero(zero_step) -> dict:
    """Rank code: ZERO_STEPS steps with `zero_step` (your code), each rank on its rows of the batch; the norm it
    logged (state["grad_norm"]) after every step, and every step's calls into torch.distributed."""
    r = dist.get_rank()
    model, flat_param, flat_grad, gains = flat_lab_model()
    x, y = zero_data()
    b = B_ZERO // P
    state: dict = {}  # this rank's optimizer state, kept by zero_step from step to step
    called: list[str] = []
    norms, steps = [], []
    for step in range(1, ZERO_STEPS + 1):
        flat_grad.zero_()
        for g in gains:
            g.grad = None
        lab_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()  # my rows' gradient
        with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as seen:
            zero_step(flat_param, flat_grad, gains, state, step)
        called += seen
        norm = state.get("grad_norm")
        one_number = isinstance(norm, (int, float)) or (isinstance(norm, torch.Tensor) and norm.numel() == 1)
        norms.append(float(norm) if one_number else None)
        steps.append({op: sum(int(c["bytes"]) for c in calls if c["op"] == op) for op in {c["op"] for c in calls}})
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "steps": steps, "library": called}


def zero_single_device() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One device, the whole batch: each step's gradient norm (torch's clip_grad_norm_: the 2-norm of all the
    gradients together), every gradient multiplied by clip_coefficient(norm), then Adam (the setup's adam_step) on
    every parameter. The parameters after ZERO_STEPS
    steps, by name, and the norms."""
    model = build_lab_model(ZERO_CFG, seed=40)
    x, y = zero_data()
    moments = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in model.named_parameters()}
    norms = []
    for step in range(1, ZERO_STEPS + 1):
        model.zero_grad()
        lab_loss(model(x), y).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        norms.append(norm.item())
        coef = clip_coefficient(norm)
        with torch.no_grad():
            for n, p in model.named_parameters():
                adam_step(p, p.grad * coef, *moments[n], step, ZERO_LR)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def collect_zero_clip(zero_step) -> dict:
    return {"ranks": list(parlab.launch(run_zero, P, zero_step, **LAUNCH))}


def judge_zero_clip(data) -> list[str]:
    ranks = data["ranks"]
    reference, norms = zero_single_device()
    model, flat_param, _, gains = flat_lab_model()
    psi_m, n_gains = flat_param.numel(), sum(g.numel() for g in gains)
    S = math.ceil(psi_m / P)  # a shard: the last one ends in padding
    lines = []
    for step in range(ZERO_STEPS):
        got = {f"rank {r}": ranks[r]["norms"][step] for r in range(P)}
        if any(v is None for v in got.values()):
            lines.append(f"step {step + 1}: the gradient norm logged in state['grad_norm']: missing: FAIL")
            continue
        what = f"step {step + 1}: the gradient norm each rank clipped by (clipped at {MAX_NORM})"
        as_tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in got.items()}  # host: the judge's numbers
        one_device = torch.tensor(norms[step], dtype=torch.float64)  # host: the judge's numbers
        lines.append(first_wrong(what, as_tensors, _every(one_device)))
    expected = {f"rank {r}: {n}": p for r in range(P) for n, p in reference.items()}
    got = {f"rank {r}: {n}": p for r in range(P) for n, p in ranks[r]["params"].items()}
    lines.append(first_wrong(f"every rank's parameters after {ZERO_STEPS} steps", got, expected))
    few = 2 * P * 8  # beside the step's own collectives, a rank may all-reduce or gather 2P numbers
    own = S * 8 + P * S * 8 + n_gains * 8  # the shard reduce-scattered, the parameters gathered, the gains reduced
    for bytes_of, what, least, most in [
        (_summed(_REDUCE_SCATTER), "bytes reduce-scattered into each rank's gradient shard", S * 8, S * 8),
        (_summed(_ALL_GATHER), "bytes all-gathered (the parameters, a few numbers more)", P * S * 8, P * S * 8 + few),
        (
            _summed(_ALL_REDUCE),
            "bytes all-reduced (the gains' gradients, a few numbers more)",
            n_gains * 8,
            n_gains * 8 + few,
        ),
        (lambda step: sum(step.values()) - own, f"bytes beside these (at most {2 * P} numbers)", 0, few),
    ]:
        per_step = [[bytes_of(step) for step in ranks[r]["steps"]] for r in range(P)]
        lines.append(_bytes_line(f"{what}, in every step", per_step, least, most))
    called = [c for res in ranks for c in res["library"]]
    lines.append(library_verdict("zero_step", called))
    return lines


def collect_clip_at_scale(predictions: dict) -> dict:
    """The predictions as plain data (numbers as floats; anything else as its text, which fails)."""
    out = {}
    for name in ("shard", "padding", "handout_norm"):
        value = predictions.get(name) if isinstance(predictions, dict) else None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        out[name] = value if isinstance(value, (int, float)) else str(value)[:40]
    return out


def judge_clip_at_scale(data) -> list[str]:
    theory = clip_at_scale_theory()
    n = PREDICT_N
    labels = {
        "shard": (f"elements of the matrices' shard each of {n} ranks holds in the fixed step", 0),
        "padding": (f"elements of padding in the last shard ({n} ranks)", 0),
        "handout_norm": (f"the norm the handed-out step clips by ({n} ranks)", 1e-3),
    }
    lines = []
    for name, (label, rtol) in labels.items():
        lines += prediction_lines(label, data[name], theory[name], rtol=rtol)
    return lines
