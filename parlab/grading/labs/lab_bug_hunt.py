"""The bug hunt's checks: six broken pieces of distributed training code, each run on live ranks as its user runs it
and compared with one device (float64), with what the ranks communicated watched at the process group.

Every rank function here is the working surroundings of one function from the notebook (the student's): the
model, the data, the single-device reference and the verdicts live here, the code under suspicion in the notebook's
ANSWER cells, written for the labs' own model (parlab.core.lab_model) or a variant the library lacks:

1. data parallelism with gradient accumulation, on documents padded to the sequence length (this file);
2. tensor parallelism of the lab model's block, its K/V heads shared by pairs of ranks (lab_bug_hunt_tp.py);
3. the next-token targets and document-wise positions of packed documents in a zigzag layout, each rank holding
   only its own block of token ids and document-start flags (this file);
4. hybrid sharding (ZeRO inside groups of ranks, replicated across them) with global-norm gradient clipping, and a
   prediction at Llama-3-8B scale (lab_bug_hunt_zero.py);
5. a 1F1B loop over the lab model's blocks, its LM head tied to its embedding, for any number of micro-batches
   (lab_bug_hunt_pipeline.py);
6. a ring-attention forward for grouped K/V heads, under the library's backward (lab_bug_hunt_ring.py).

A verdict says what the user sees, at the level they see it: the loss of each step, the norm they log, every
parameter after training (the largest error, no tensor named), a hang, the bytes moved; never where the cause is.
Finding it is the student's work, with the pieces each part hands out (its data, model, rank code and one-device
reference, all importable) and parlab's tools (parlab.launch and its hang diagnosis, parlab.compare, the probe,
comm's trace). What the answers must not call (LIBRARY, parlab/grading/labs/guard.py), the sizes and the shared
helpers are in lab_bug_hunt_setup.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.core import probe
from parlab.core.lab_model import build_lab_model, lab_batches, lab_loss
from parlab.grading.labs import lab_bug_hunt_pipeline as pipeline_part
from parlab.grading.labs import lab_bug_hunt_ring as ring_part
from parlab.grading.labs import lab_bug_hunt_tp as tp_part
from parlab.grading.labs import lab_bug_hunt_zero as zero_part
from parlab.grading.labs import run_check
from parlab.grading.labs.guard import library_calls
from parlab.grading.labs.lab_bug_hunt_setup import (
    B_DP,
    DP_CFG,
    DP_LENGTHS,
    DP_LR,
    DP_STEPS,
    IGNORE,
    LAUNCH,
    LIBRARY,
    PAD,
    ZIGZAG_T,
    ZZ_B,
    ZZ_CFG,
    ZZ_DOCS,
    ZZ_SENT,
    M,
    P,
    _no_error,
    bytes_line,
    curve_line,
    digits_apart,
    every_rank,
    library_verdict,
)
from parlab.grading.labs.lab_bug_hunt_zero import clip_at_scale_theory

__all__ = ["LIBRARY", "PARTS", "STRUCTURAL", "THEORY", "run"]

PARTS = (tp_part, zero_part, pipeline_part, ring_part)  # the checks of parts 2, 4, 5 and 6 live there

STRUCTURAL = {
    "dp_tokens": "the lab model trained 3 SGD steps on 4 ranks, 2 micro-batches each, on documents padded with PAD "
    "inputs and ignored targets (every rank and micro-batch with its own count of real targets): the loss after each"
    " step and every rank's parameters after the last equal one device's on the whole batch (the mean over "
    "its real targets); each rank communicates one copy of the gradients and at most 2P more numbers per "
    "step; no call into parlab's data parallelism",
    "tp_training": "the lab model's block (RMSNorm, grouped-query attention with 4 query heads on 2 K/V heads, SwiGLU "
    "without biases, residuals) with Megatron's f and g on 4 ranks, trained 3 SGD steps: the loss of each step and "
    "every rank's weights after the last (its slices and its replicas) equal one device's; each rank communicates "
    "one [B, T, H] per sublayer in forward and one in backward, and after backward the gradients of its K/V head "
    "only; no call into parlab's tensor parallelism",
    "zigzag_targets": "for T = 16, 20, 24 and 23 on 4 ranks (2P chunks cut by torch.tensor_split), 2 sequences of "
    "packed documents each (short ones, and ones over 3 to 6 chunk edges), each rank given only its zigzag block of "
    "token ids and document-start flags: every rank's targets (the next token, IGNORE where it begins another "
    "document and for the last token) and positions (each token's place in its document, 0 at its start), each, "
    "equal one device's in the same layout (a FAIL shows the loss of the lab model, RoPE by the ranks' positions, "
    "plain causal mask, against one device's with the true positions, and the first target or position that "
    "differs); each rank exchanges only with ranks r-1 and r+1, point to point, and sends each at most two numbers "
    "per sequence; no call into parlab's sequence code",
    "zero_clip": "3 Adam steps with the gradient clipped at a global norm, the lab model's matrices sharded over "
    "shard groups and replicated across them, on two layouts in this order (one group of 4, its last shard padded; "
    "groups of 2 ranks, replicated twice), its RMSNorm gains replicated: on each layout the norm each rank clipped "
    "by (a FAIL shows the numbers for the first layout whose norm differs only) and every "
    "parameter equal one device's; per step each rank reduce-scatters the gradient in its shard group, all-reduces "
    "its shard across the replicas (if it has any), all-gathers the parameters in its shard group and "
    "all-reduces the gains' gradients, and at most 2P numbers more, nothing else; no call into parlab's ZeRO",
    "clip_at_scale": "predictions for a Llama-3-8B-sized lab model on 640 ranks, tensor parallel over 16 (8 K/V "
    "heads: each held whole by 2 ranks) and each rank's slices sharded in shard groups of 10: the fixed step's "
    "shard and padding (exact) and the norm the handed-out step's sum clips by (0.1%)",
    "pipeline_m": "the lab model (LM head tied to the embedding) over 4 stages, m = 4, 3, 2 and 1 micro-batches, "
    "2 SGD steps each: no hang (a hang fails within seconds, naming each "
    "rank's call), the loss of each step and every stage's parameters after the last equal one device's; every "
    "stage sends m activations forward and m gradients back per step, and the first and last stage all-reduce the "
    "tied matrix's gradient once, nothing else; stage s holds the activations of at most min(p - s, m) micro-batches "
    "at once (1F1B's memory: GPipe's all-forwards-first loop and one warm-up forward too many fail); no call into "
    "parlab's pipeline code (not known, and a FAIL, for a launch whose ranks did not finish)",
    "ring_gqa": "a ring-attention forward of grouped K/V heads under the library's backward, for (nq, nkv) = (4, 4) "
    "and (6, 2): the output and dL/dq, dL/dk, dL/dv equal one device's causal attention; each rank sends P-1 K/V "
    "blocks of the nkv heads only in forward, and no tensor its forward makes holds a K/V block copied for each "
    "query head (watched with a TorchFunctionMode: the library's tiles on repeated K/V fail); no call into "
    "parlab's sequence code",
}

# The predictions' theory, one function per PREDICT cell: what its judge scores against.
THEORY = {"clip_at_scale": clip_at_scale_theory}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# --------------------------------------------------------------- part 1: data parallel, accumulation, padded documents


def dp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The DP_STEPS global batches of token ids, x, y [B_DP, T] each: in batch k, document i has
    DP_LENGTHS[(i + 5 k) % B_DP] real targets, then padding (input PAD, target IGNORE: the loss leaves it out)."""
    batches = []
    for k, (x, y) in enumerate(lab_batches(DP_CFG, B_DP, DP_STEPS, seed=11, device=parlab.device())):
        for i in range(B_DP):
            n = DP_LENGTHS[(i + 5 * k) % B_DP]
            x[i, n:], y[i, n:] = PAD, IGNORE
        batches.append((x, y))
    return batches


def dp_sgd(model: torch.nn.Module) -> None:
    """The step after train_step, on every rank: p <- p - DP_LR p.grad, and the gradients dropped."""
    with torch.no_grad():
        for p in model.parameters():
            p -= DP_LR * p.grad
            p.grad = None


def run_dp(train_step) -> dict:
    """Rank code: DP_STEPS steps of training from the same weights on every rank, rank r on rows [r b, (r+1) b) of
    each global batch: `train_step` (your code), then SGD. Returns the parameters after each step and the bytes
    each step communicated (the process group watched)."""
    r, b = dist.get_rank(), B_DP // P
    model = build_lab_model(DP_CFG, seed=10, device=parlab.device())  # the same weights on every rank
    params, sent, called = [], [], []
    for x, y in dp_batches():
        with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as seen:
            train_step(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b], M)
        dp_sgd(model)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        sent.append(sum(int(c["bytes"]) for c in calls))
        called += seen
    return {"params": params, "bytes": sent, "library": called}


def dp_single_device() -> list[dict[str, torch.Tensor]]:
    """One device on each whole batch (lab_loss: the mean over its real targets), then the same SGD: the parameters
    after each step."""
    model = build_lab_model(DP_CFG, seed=10)
    out = []
    for x, y in dp_batches():
        lab_loss(model(x), y).backward()
        dp_sgd(model)
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def dp_initial() -> dict[str, torch.Tensor]:
    """The weights every rank and one device start from."""
    return {n: p.detach().clone() for n, p in build_lab_model(DP_CFG, seed=10).named_parameters()}


def dp_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    """The lab model's loss on the whole batch x, y with these parameters (the user's loss curve)."""
    model = build_lab_model(DP_CFG, seed=10)
    model.load_state_dict(params)
    with torch.no_grad():
        return lab_loss(model(x), y).item()


def collect_dp_tokens(train_step) -> dict:
    return {"ranks": list(parlab.launch(run_dp, P, train_step, **LAUNCH))}


def _curve(params: list[dict[str, torch.Tensor]], batches) -> list[float]:
    """The training loss of each step: step k's batch with the parameters it started from."""
    before = [dp_initial(), *params[:-1]]
    return [dp_loss(p, x, y) for p, (x, y) in zip(before, batches, strict=True)]


def judge_dp_tokens(data) -> list[str]:
    ranks, reference, batches = data["ranks"], dp_single_device(), dp_batches()
    psi = sum(p.numel() for p in reference[0].values())
    got, _ = _no_error("", _curve, ranks[0]["params"], batches)
    what = f"the loss of each of {DP_STEPS} steps (the whole batch, rank 0's parameters)"
    what_bytes = f"bytes each rank communicates in each step (one copy of the gradients, and at most {2 * P} numbers)"
    last = [res["params"][-1] for res in ranks]
    return [
        curve_line(what, got if got is not None else "nothing", _curve(reference, batches)),
        every_rank(f"every rank's parameters after {DP_STEPS} steps", last, reference[-1]),
        bytes_line(what_bytes, [res["bytes"] for res in ranks], psi * 8, psi * 8 + 2 * P * 8),
        library_verdict("train_step", [c for res in ranks for c in res["library"]]),
    ]


# ------------------------------------------------------ part 3: the targets of packed documents, zigzag, sharded


def zigzag_block(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s zigzag block of a [B, T] tensor: chunks rank and 2P-1-rank of the sequence's 2P chunks, side by
    side, [B, w]."""
    chunks = t.tensor_split(2 * P, dim=1)
    return torch.cat([chunks[rank], chunks[2 * P - 1 - rank]], dim=1)


def zigzag_problem(T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ZZ_B sequences of T token ids x [ZZ_B, T], each packing documents of the lengths ZZ_DOCS[T] (no id twice in
    a sequence: a wrong target never looks right); starts [ZZ_B, T] bool, True where a token begins a document; the
    targets y [ZZ_B, T]: the next token, IGNORE where the next token begins another document and for the last; and
    the positions pos [ZZ_B, T]: each token's place in its document (0 at its start)."""
    gen = torch.Generator().manual_seed(30 + T)
    x = torch.stack([torch.randperm(ZZ_CFG.vocab_size, generator=gen)[:T] for _ in range(ZZ_B)])  # host: the draw
    x = x.to(parlab.device())
    starts = torch.zeros(ZZ_B, T, dtype=torch.bool, device=parlab.device())
    pos = torch.zeros(ZZ_B, T, dtype=torch.int64, device=parlab.device())
    for i, lengths in enumerate(ZZ_DOCS[T]):
        starts[i, [sum(lengths[:d]) for d in range(len(lengths))]] = True
        pos[i] = torch.cat([torch.arange(n, device=parlab.device()) for n in lengths])
    y = torch.full_like(x, IGNORE)
    y[:, :-1] = x[:, 1:].masked_fill(starts[:, 1:], IGNORE)
    return x, starts, y, pos


def run_zigzag(zigzag_targets) -> dict:
    """Rank code: for each T, rank r holds only its zigzag block of the token ids, x_r [B, w], and of the
    document-start flags, starts_r (the same shape), and asks `zigzag_targets` (your code) for their targets and
    positions; its calls into torch.distributed are recorded (and how many numbers each send carried)."""
    r, out = dist.get_rank(), {}
    for T in ZIGZAG_T:
        x, starts, _, _ = zigzag_problem(T)
        x_r, starts_r = zigzag_block(x, r), zigzag_block(starts, r)
        with probe.recording() as calls, library_calls(LIBRARY) as called:
            answer = zigzag_targets(x_r.clone(), starts_r.clone())
        calls = [
            {"op": c["op"], "peer": int(c["peer"]), "numbers": int(c["data"].numel()) if "data" in c else 0}
            for c in calls
        ]
        out[T] = {"answer": answer, "calls": calls, "library": called}
    return out


def collect_zigzag_targets(zigzag_targets) -> dict:
    return {"ranks": list(parlab.launch(run_zigzag, P, zigzag_targets, **LAUNCH))}


def _shape(value) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _stray_call(ranks, T: int) -> str:
    """'' when every rank only sends to and receives from ranks r-1 and r+1, at most ZZ_SENT numbers per sequence
    to each."""
    most = ZZ_SENT * ZZ_B
    for r in range(P):
        calls = ranks[r][T]["calls"]
        for c in calls:
            if c["op"] not in ("send", "recv") or c["peer"] not in (r - 1, r + 1):
                peer = f" with rank {c['peer']}" if c["peer"] >= 0 else ""
                return f"rank {r}: expected sends and receives with ranks r-1, r+1 only, received {c['op']}{peer}"
        for peer in (r - 1, r + 1):
            sent = sum(c["numbers"] for c in calls if c["op"] == "send" and c["peer"] == peer)
            if sent > most:
                return (
                    f"rank {r}: expected at most {most} numbers sent to rank {peer} ({ZZ_B} sequences), received {sent}"
                )
    return ""


def zigzag_loss(targets: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> float:
    """The lab model's loss on x [B, T] with these targets [B, T], each sequence rotated (RoPE) by its own positions
    [T] (a row of pos [B, T]; a plain causal mask), on one device: the user's symptom."""
    model = build_lab_model(ZZ_CFG, seed=31)
    with torch.no_grad():
        logits = torch.cat([model(x[i : i + 1], pos[i]) for i in range(x.shape[0])])  # [B, T, V]
        return lab_loss(logits, targets).item()


def unzigzag(blocks: list[torch.Tensor], T: int) -> torch.Tensor:
    """The ranks' blocks (zigzag_block's) back in sequence order: [B, T]."""
    sizes = [len(c) for c in torch.arange(T).tensor_split(2 * P)]  # host: the chunks' lengths
    pieces: list[torch.Tensor | None] = [None] * (2 * P)
    for r, block in enumerate(blocks):
        pieces[r], pieces[2 * P - 1 - r] = block.split([sizes[r], sizes[2 * P - 1 - r]], dim=1)
    return torch.cat(pieces, dim=1)


def _answer_shape(answer, want: torch.Tensor) -> str:
    """'' when the answer is (targets, positions), each a tensor of want's shape; else what came instead."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return f"expected (targets, positions), received {type(answer).__name__}"
    for name, got in zip(("targets", "positions"), answer, strict=True):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return f"expected {name} of shape {list(want.shape)}, received {_shape(got)}"
    return ""


def _targets_line(ranks, T: int) -> str:
    """The verdict on every rank's targets and positions, each against one device's, said as the user sees it (the
    loss they give against one device's) with the first target or position that differs."""
    x, _, y, pos = zigzag_problem(T)
    what = f"T={T}: the loss with the ranks' targets and positions"
    for r in range(P):
        wrong = _answer_shape(ranks[r][T]["answer"], zigzag_block(y, r))
        if wrong:
            return f"{what}: rank {r}: {wrong}: FAIL"
    got_y, got_pos = (unzigzag([ranks[r][T]["answer"][k].to(torch.int64) for r in range(P)], T) for k in (0, 1))
    expected = zigzag_loss(y, pos, x)
    if torch.equal(got_y, y) and torch.equal(got_pos, pos):
        return f"{what}: {expected:.6f}, as one device's: PASS"
    got, error = _no_error(what, zigzag_loss, got_y, got_pos, x)  # a target out of the vocabulary: no loss at all
    first = _first_wrong(ranks, y, pos, T)
    if got is None:
        return f"{what}: expected {expected:.6f} (one device), received no loss; {first}: FAIL"
    want, came = digits_apart(expected, got)
    return f"{what}: expected {want} (one device), received {came}; {first}: FAIL"


def _first_wrong(ranks, y: torch.Tensor, pos: torch.Tensor, T: int) -> str:
    """The first target or position that differs from one device's, rank by rank, sequence by sequence and column by
    column of the block."""
    for r in range(P):
        got = [t.to(torch.int64) for t in ranks[r][T]["answer"]]
        want = (zigzag_block(y, r), zigzag_block(pos, r))
        for i in range(ZZ_B):
            for j in range(want[0].shape[1]):
                for name, g, w in zip(("target", "position"), got, want, strict=True):
                    if g[i, j] != w[i, j]:
                        where = f"rank {r}, sequence {i}, column {j} of its block"
                        return f"{where}: expected {name} {int(w[i, j])}, received {int(g[i, j])}"
    return "every target and position as one device's"


def judge_zigzag_targets(data) -> list[str]:
    ranks, lines = data["ranks"], []
    for T in ZIGZAG_T:
        lines.append(_targets_line(ranks, T))
        stray = _stray_call(ranks, T)
        what = (
            f"T={T}: each rank exchanges with its neighbours only, sending each at most {ZZ_SENT} numbers per sequence"
        )
        lines.append(f"{what}: {f'{stray}: FAIL' if stray else 'PASS'}")
    called = [c for res in ranks for T in ZIGZAG_T for c in res[T]["library"]]
    lines.append(library_verdict("zigzag_targets", called))
    return lines
