"""The bug hunt, part 4: hybrid sharding (ZeRO inside groups of ranks, replicated across them) with global-norm
gradient clipping, and its prediction at Llama-3-8B scale.

The lab model's matrices (every 2-D parameter) lie side by side in one flat buffer, padded into `shard` equal
shards; rank r holds shard r % shard of them (master weights and Adam's moments), as does every rank of its
replica group.
A step (Rajbhandari et al. 2020's stage-2 communication inside a shard group; PyTorch FSDP's HYBRID_SHARD and
Zhao et al. 2023's hybrid sharding across groups): reduce-scatter the gradient in the shard group, all-reduce the
shard across the replicas, average, Adam on the shard, all-gather the parameters in the shard group. The RMSNorm
gains are replicated on every rank, their gradients all-reduced over all ranks. Clipping (Pascanu et al. 2013)
multiplies every gradient by min(1, max_norm / (norm + 1e-6)), the norm that of the whole model's averaged
gradient, as torch.nn.utils.clip_grad_norm_ computes it on one device. The check runs every layout of
ZERO_LAYOUTS (one shard group of all P ranks; shard groups of 2, replicated twice).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.core.lab_model import LabModel, build_lab_model, lab_batches, lab_loss
from parlab.grading.labs import prediction_lines
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab_bug_hunt_setup import (
    ALL_GATHER,
    ALL_REDUCE,
    B_ZERO,
    LAUNCH,
    LIBRARY,
    MAX_NORM,
    PREDICT_CFG,
    PREDICT_N,
    PREDICT_NORMS,
    PREDICT_SHARD,
    PREDICT_TP,
    REDUCE_SCATTER,
    ZERO_CFG,
    ZERO_LAYOUTS,
    ZERO_LR,
    ZERO_STEPS,
    P,
    adam_step,
    bytes_line,
    clip_coefficient,
    curve_line,
    library_verdict,
)


def zero_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of token ids: x, y [B_ZERO, T]; rank r trains on rows [r b, (r+1) b), b = B_ZERO / P."""
    x, y = lab_batches(ZERO_CFG, B_ZERO, 1, seed=41, device=parlab.device())[0]
    return x, y


def flat_lab_model(seed: int = 40) -> tuple[LabModel, torch.Tensor, torch.Tensor, list[torch.nn.Parameter]]:
    """The lab model whose matrices (every 2-D parameter, in named_parameters() order) are views of two flat buffers
    of PSI_M numbers (no padding): flat_param (writing it writes the matrices) and flat_grad (backward adds into it);
    and its RMSNorm gains, [H] each, as they are (replicated on every rank, each with its own .grad)."""
    model = build_lab_model(ZERO_CFG, seed, device=parlab.device())
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


def hybrid_groups(shard: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the shard groups, the replica groups) of `shard` ranks per shard group: rank r shards with the ranks of
    group r // shard and is replicated across the ranks holding the same shard (r % shard)."""
    shards = [list(range(g * shard, (g + 1) * shard)) for g in range(P // shard)]
    replicas = [list(range(i, P, shard)) for i in range(shard)]
    return shards, replicas


def run_zero(zero_step, shard: int) -> dict:
    """Rank code: the process groups of shard groups of `shard` ranks made (every rank makes each, in order); then
    ZERO_STEPS steps with `zero_step` (your code), each rank on its rows of the batch; the norm it logged
    (state["grad_norm"]) after every step, every step's calls into torch.distributed (with the ranks of their group)
    and the parameters after the last."""
    r = dist.get_rank()
    shards, replicas = hybrid_groups(shard)
    made = {tuple(ranks): dist.new_group(ranks) for ranks in shards + replicas}
    shard_group = made[tuple(next(g for g in shards if r in g))]
    replica_group = made[tuple(next(g for g in replicas if r in g))]
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
        with probe.recording(keep_sent_data=False, with_groups=True) as calls, library_calls(LIBRARY) as seen:
            zero_step(flat_param, flat_grad, gains, state, step, shard_group, replica_group)
        called += seen
        norm = state.get("grad_norm")
        one_number = isinstance(norm, (int, float)) or (isinstance(norm, torch.Tensor) and norm.numel() == 1)
        norms.append(float(norm) if one_number else None)
        steps.append([[c["op"], len(c["group"]), int(c["bytes"])] for c in calls])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "steps": steps, "library": called}


def zero_single_device() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One device, the whole batch: each step's gradient norm (torch's clip_grad_norm_: the 2-norm of all the
    gradients together), every gradient multiplied by clip_coefficient(norm), then Adam (the setup's adam_step) on
    every parameter. The parameters after ZERO_STEPS steps, by name, and the norms."""
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
    return {str(shard): list(parlab.launch(run_zero, P, zero_step, shard, **LAUNCH)) for shard in ZERO_LAYOUTS}


def _bytes(step: list, ops: tuple[str, ...], size: int | None) -> int:
    """The bytes of one step's calls of these process-group methods on groups of `size` ranks (None: any)."""
    return sum(b for op, n, b in step if op in ops and (size is None or n == size))


def judge_zero_clip(data) -> list[str]:
    reference, norms = zero_single_device()
    lines = []
    for shard in ZERO_LAYOUTS:  # the logged norm's numbers for the first layout whose norm is wrong only
        shown = any(line.endswith(": FAIL") and "gradient norm" in line for line in lines)
        lines += _judge_layout(data[str(shard)], shard, reference, norms, numbers=not shown)
    called = [c for shard in ZERO_LAYOUTS for res in data[str(shard)] for c in res["library"]]
    lines.append(library_verdict("zero_step", called))
    return lines


def _judge_layout(ranks: list[dict], shard: int, reference: dict, norms: list[float], numbers: bool) -> list[str]:
    """The verdicts on one layout: shard groups of `shard` ranks, replicated P / shard times. numbers: a wrong norm
    says the first step's expected and received norm (else only that it is wrong: a second layout's numbers beside
    the first's would give the cause by a division, not by a measurement)."""
    _, flat_param, _, gains = flat_lab_model()
    psi_m, n_gains = flat_param.numel(), sum(g.numel() for g in gains)
    S = math.ceil(psi_m / shard)  # a shard: the last one ends in padding where shard does not divide PSI_M
    R = P // shard  # replicas
    layout = f"shard groups of {shard} ({R} {'replica' if R == 1 else 'replicas'})"
    lines = []
    for r in range(P):
        got = ranks[r]["norms"]
        if any(v is None for v in got):
            lines.append(f"{layout}: the gradient norm logged in state['grad_norm'], rank {r}: missing: FAIL")
            break
    else:  # the same curve on every rank: the first rank whose curve differs speaks for all
        what = f"{layout}: the gradient norm clipped by in each of {ZERO_STEPS} steps (clipped at {MAX_NORM})"
        curves = [curve_line(f"{what}, rank {r}", ranks[r]["norms"], norms) for r in range(P)]
        wrong = [line for line in curves if line.endswith(": FAIL")]
        if wrong and not numbers:
            r = curves.index(wrong[0])
            wrong[0] = f"{what}, rank {r}: differs (numbers shown for the first layout whose norm differs only): FAIL"
        lines.append(wrong[0] if wrong else curve_line(f"{what}, every rank", ranks[0]["norms"], norms))
    params = [res["params"] for res in ranks]
    lines.append(compare(f"{layout}: every rank's parameters after {ZERO_STEPS} steps", params, [reference] * P).line)
    few = 2 * P * 8  # beside the step's own collectives, a rank may all-reduce or gather 2P numbers
    own = S * 8 + shard * S * 8 + (S * 8 if R > 1 else 0) + n_gains * 8
    alone = (lambda st: _bytes(st, ALL_REDUCE, 1)) if R == 1 else (lambda st: 0)  # a replica group of one: free
    checks = [
        (lambda st: _bytes(st, REDUCE_SCATTER, shard), "bytes reduce-scattered in the shard group", S * 8, S * 8),
        (
            lambda st: _bytes(st, ALL_GATHER, shard),
            "bytes all-gathered in the shard group",
            shard * S * 8,
            shard * S * 8,
        ),
        (lambda st: _bytes(st, ALL_REDUCE, P), "bytes all-reduced over all ranks", n_gains * 8, n_gains * 8 + few),
        (
            lambda st: _bytes(st, tuple({op for op, _, _ in st}), None) - own - alone(st),
            f"bytes beside these (at most {2 * P} numbers)",
            0,
            few,
        ),
    ]
    if R > 1:
        checks.insert(
            1, (lambda st: _bytes(st, ALL_REDUCE, R), "bytes all-reduced across the replicas", S * 8, S * 8 + few)
        )
    for bytes_of, what, least, most in checks:
        per_step = [[bytes_of(step) for step in res["steps"]] for res in ranks]
        lines.append(bytes_line(f"{layout}: {what}, in every step", per_step, least, most))
    return lines


# ------------------------------------------------------------------------------------------------ the prediction


def clip_at_scale_theory() -> dict[str, float]:
    """THEORY of the prediction: the lab model at PREDICT_CFG on PREDICT_N ranks, tensor parallel over PREDICT_TP
    (Megatron's slices of q, o, gate, up, down, and of the embedding's and the head's vocabulary rows; the K/V heads
    whole, each on PREDICT_TP / kv_heads ranks when there are fewer K/V heads than ranks), each rank's matrices flat
    and padded into PREDICT_SHARD equal shards over its shard group, replicated across the rest: the shard each rank
    holds in the fixed step and the padding of the last one; and the norm the handed-out step's sum clips by when
    the averaged gradient's three parts have the norms PREDICT_NORMS."""
    c = PREDICT_CFG
    V, H, L, F_, tp = c["vocab"], c["hidden"], c["layers"], c["ffn"], PREDICT_TP
    hd = H // c["heads"]
    sliced = (2 * V * H + L * (2 * H * H + 3 * F_ * H)) // tp  # this rank's slices: embedding, head; q, o; the MLP
    kv_per_rank = max(1, c["kv_heads"] // tp)  # K/V heads a rank holds, whole
    holders = max(1, tp // c["kv_heads"])  # tensor-parallel ranks holding each K/V head
    matrices = sliced + L * 2 * kv_per_rank * hd * H  # ... and its K/V heads' rows of k and v
    shard = math.ceil(matrices / PREDICT_SHARD)
    replicas = PREDICT_N // (tp * PREDICT_SHARD)  # ranks that hold each shard of a slice
    a, b, g = PREDICT_NORMS["sliced"], PREDICT_NORMS["kv"], PREDICT_NORMS["gains"]
    # The handed-out sum: every rank's shard and the gains, all-reduced over all ranks: each number counted once per
    # rank that holds it.
    squares = replicas * a * a + replicas * holders * b * b + PREDICT_N * g * g
    return {"shard": shard, "padding": PREDICT_SHARD * shard - matrices, "handout_norm": math.sqrt(squares)}


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
    where = f"{PREDICT_N} ranks, tp {PREDICT_TP}, shard groups of {PREDICT_SHARD}"
    labels = {
        "shard": (f"elements of the matrices' shard each rank holds in the fixed step ({where})", 0),
        "padding": (f"elements of padding in the last shard ({where})", 0),
        "handout_norm": (f"the norm the handed-out step's sum clips by ({where})", 1e-3),
    }
    lines = []
    for name, (label, rtol) in labels.items():
        lines += prediction_lines(label, data[name], theory[name], rtol=rtol)
    return lines
