"""Lab 02's checks: the conjugate operators of a sequence-parallel region whose tokens are dealt to the ranks by
any layout, uneven included (the whole sequence assembled and each rank's tokens of a sum kept, and their backwards,
between ring neighbours with no padding on the wire; Megatron's f and g are handed out); the lab model's SwiGLU MLP
forward in the sequence-parallel region without ever gathering the sequence (one way round a ring, a few blocks held
at once whatever P, each receive hidden behind a GEMM, the work split by hidden units); its grouped-query attention
split by heads when there are fewer K/V heads than ranks, at positions that are not 0..T-1; a vocabulary-parallel
cross-entropy in one collective; and a prediction of the bytes over the busiest link of that MLP at an uneven size no
check runs, beside the same forward in Megatron-SP form.

Every check runs the student's code on P live ranks, each rank handed the same full problem (float64), and compares
with one device computing the whole thing (parlab.core.lab_model for the MLP and the attention). A recorder sees
every call the code makes into torch.distributed (library calls included, with the group each ran on) and what each
rank *contributes* to it (an all-gather's input, a reduce-scatter's whole input, an all-reduce's tensor), in
forward, in backward and in the gradient sync separately. Calls into the library's own tensor- and
sequence-parallel code (`LIBRARY`) are seen too (parlab/grading/labs/guard.py): the lab asks for the student's own.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core import probe
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, apply_rope, build_lab_model
from parlab.grading.labs import error_summary, p2p_events, prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab02_watch import Watch

LAUNCH = {"timeout": 20, "echo": False}  # a hang (a collective some rank never calls) stops after 20 s
P, BATCH, T = 4, 2, 4  # ranks; the cross-entropy's rows are [BATCH, T]
H = 8  # the sequence-parallel pair's hidden size
V = 32  # the cross-entropy: logits [N, V] with N = BATCH * T rows
# The sequence-parallel parts: SEQ tokens dealt to the P ranks; layout[r] lists the tokens rank r holds, in the order
# it holds them (x_r[:, i] is token layout[r][i]). 10 tokens on 4 ranks cannot be dealt evenly.
SEQ = 10
LAYOUTS = {
    "contiguous": [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]],
    "striped": [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]],
    "scattered": [[5, 0], [1, 6, 9], [2, 7], [3, 8, 4]],
}
# Part 2: the lab model's SwiGLU MLP, H -> F -> H, forward only ("prefill"), in the sequence-parallel region without
# ever gathering the sequence: each rank holds its tokens, [B, n_r, H], and the full weights. The memory bounds, in
# blocks of B max(n_r) H numbers: at most TENSOR_BLOCKS in one tensor (the whole sequence, 10 tokens on 4 ranks, is
# over it), at most LIVE_BLOCKS alive at once whatever P (on 8 ranks, holding every rank's partial result is over it).
MLP_CFG = LabConfig(vocab_size=V, seq_len=SEQ, hidden=16, heads=4, kv_heads=2, ffn=24, layers=1)
TENSOR_BLOCKS, LIVE_BLOCKS = 2, 8
EIGHT = [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9], [10, 11, 12], [13, 14], [15, 16, 17], [18, 19]]  # 20 tokens, 8 ranks
SWIGLU_CASES = {  # name: the layout the tokens are dealt by (uneven: 3-3-2-2, 2-3-2-3 in a scattered order, 3-2-...)
    "contiguous layout": LAYOUTS["contiguous"],
    "scattered layout": LAYOUTS["scattered"],
    "8 ranks, contiguous": EIGHT,
}
# Part 3: the lab model's attention, nq query heads, nkv < P key/value heads, head size hd = H / nq, on a packed
# sequence: each token has a document and a position in it (RoPE by that position), and attends to the tokens of its
# own document at positions up to its own. The rows the attention sees need not be in sequence order: `order` lists
# the sequence index of each row (None: in order; "ranks": the sequence-parallel region's rows in the ranks' order,
# rank 0's tokens, then rank 1's, ...).
_GQA = {"vocab_size": V, "seq_len": 16, "hidden": 32, "ffn": 32, "layers": 1}
RESUMED = ([5, 6, 7, 8, 9, 10, 11, 0, 1, 2], [0] * 7 + [1] * 3)  # a document resumed at 5, then the next one's start
PACKED = ([0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [0] * 6 + [1] * 4)  # two documents in one sequence
PACKED_LATE = ([3, 4, 5, 6, 7, 0, 1, 2, 3, 4], [0] * 5 + [1] * 5)  # the end of one document, then the next's start
SHUFFLED = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]
GQA_CASES = {  # name: (config, (positions, documents), the region's layout (None: tensor-parallel), the rows' order)
    "nq=4, nkv=2, rows in order": (LabConfig(**_GQA, heads=4, kv_heads=2), RESUMED, None, None),
    "nq=8, nkv=2, rows shuffled": (LabConfig(**_GQA, heads=8, kv_heads=2), PACKED, None, SHUFFLED),
    "nq=4, nkv=1, sequence-parallel (striped), rows in the ranks' order": (
        LabConfig(**_GQA, heads=4, kv_heads=1),
        PACKED_LATE,
        "striped",
        "ranks",
    ),
}
# The prediction: part 2's forward at a size no check runs, RING_P ranks holding RING_COUNTS tokens each (rank r the
# next RING_COUNTS[r] tokens of the sequence), RING_BATCH sequences, RING_CFG's sizes, float64.
RING_P = 6
RING_COUNTS = [5, 3, 4, 2, 6, 4]
RING_BATCH = 3
RING_CFG = LabConfig(vocab_size=64, seq_len=sum(RING_COUNTS), hidden=96, heads=8, kv_heads=2, ffn=48, layers=1)
LIBRARY = (
    "schemes/tensor_parallel.py",
    "schemes/sequence/sequence_parallel.py",
    "lessons/tensor_parallel.py",
    "lessons/tensor_parallel_memory.py",
    "lessons/sequence_parallel.py",
)

STRUCTURAL = {
    "conjugates": "for three layouts of 10 tokens on 4 ranks (contiguous, striped, scattered: uneven, the order "
    "within a rank given): gather_tokens returns the whole sequence in order on every rank, and its backward gives "
    "each rank its tokens of the gradient summed over ranks; scatter_tokens each rank's tokens of the ranks' sum, and "
    "its backward every token's gradient on every rank; in each direction point-to-point messages only, each with a "
    "ring neighbour (r - 1 or r + 1), and, bytes measured per rank, where the sequence is assembled (gather forward, "
    "scatter backward) each rank receives exactly B (T - n_r) H numbers, where partial sums are summed (scatter "
    "forward, gather backward) each rank sends exactly B (T - n_r) H numbers (padding to the largest count, or a "
    "collective, fails); every backward leaves autograd's incoming gradient unchanged; no call into the library's "
    "tensor- or sequence-parallel code (f and g are handed out, not graded)",
    "swiglu": "the lab model's SwiGLU MLP (F = 24) forward only, under no_grad, on each rank's tokens of two uneven "
    "layouts on 4 ranks (contiguous 3-3-2-2, scattered 2-3-2-3) and of 20 tokens on 8 ranks (3-2-3-2-...), every "
    "rank handed the full weights: y on each rank (its tokens) equal to one device's in float64; point-to-point "
    "messages only, one way round the ring (each rank sends to one neighbour only and receives from the other "
    "only), every one through parlab.core.comm; memory, watched by a TorchFunctionMode that sees every tensor the "
    "forward's torch calls return (views of what it was handed aside, a storage counted once): no tensor holds more "
    "than 2 B max(n_r) H numbers, and after every call the tensors still alive (weak references) hold at most "
    "8 B max(n_r) H numbers, whatever P (holding every rank's partial result fails on 8 ranks); the work split by "
    "units: the operands of each rank's GEMMs, compared row by row with the weights, are the gate rows, up rows and "
    "down columns of the same F/P units, no unit on two ranks, and its GEMMs do exactly 3 B T H F/P multiply-adds "
    "(every token through its units once); overlap (parlab.core.comm's trace against the GEMMs' times): every "
    "receive but each rank's last issued before a GEMM began and waited for after it ended, and a rank that receives "
    "nothing fails; no call into the library's tensor- or sequence-parallel code",
    "gqa": "the lab model's attention on a packed sequence (each row attends to its own document's rows at positions "
    "up to its own; RoPE by each row's position in its document), the positions and documents given per row of what "
    "enter returns: nq=4/nkv=2 on a document resumed at position 5 then the next one's start, rows in order; "
    "nq=8/nkv=2 on a packed sequence, rows shuffled; nq=4/nkv=1 in a sequence-parallel region on the striped layout, "
    "rows in the ranks' order (the lab model's causal mask by row index fails all three, RoPE by 0..T-1 the last "
    "two): y and dL/dx on every rank (each rank's tokens) equal one device's; q and o hold this rank's query heads, "
    "k and v rows copied from the full ones, at most hd each; the q and o gradients and, after sync_grads, the k and "
    "v gradients of the rows each rank holds equal one device's; the region's operators once each way and nothing "
    "else (splitting a K/V head needs more); sync_grads all-reduces only, at most 2 hd H numbers from each rank (an "
    "all-reduce of k and v over all ranks sums two heads' gradients where nkv=2; one slot per head is over the "
    "budget); no call into the library",
    "vocab_ce": "the loss from one call into torch.distributed in forward to which each rank contributes at most 2 "
    "numbers per row (an all-gather's input, an all-reduce's whole tensor: a padded all-reduce of every rank's "
    "numbers fails), none in backward; rows with logits near 1000 included (exp overflows there without a common "
    "shift); no call into the library's loss",
    "layer_bytes": "two predictions, exact, at a size no check runs (6 ranks holding 5, 3, 4, 2, 6, 4 tokens, B = 3, "
    "H = 96, float64): the bytes over the busiest link in one direction of part 2's forward (one that meets part 2's "
    "checks and sends nothing over more links than it needs) and of the same forward in Megatron-SP form as the "
    "library runs it (an all-gather and a reduce-scatter of blocks padded to the largest count, on rings); once both "
    "are right, shown (not scored) what the student's own part 2 sent over its busiest link when run at that size",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)  # host: the seeded draw


def _on_device(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(parlab.device()) for name, t in data.items()}


def _tokens(layout: list[list[int]], rank: int) -> torch.Tensor:
    """The sequence indices rank `rank` holds, in its order, as an index tensor."""
    return torch.tensor(layout[rank], dtype=torch.long, device=parlab.device())


# ------------------------------------------------------------------------------------- what each rank sends

# ProcessGroup methods whose first argument is the output: what the rank contributes is the second.
_OUTPUT_FIRST = ("allgather", "all_gather", "reduce_scatter", "alltoall", "all_to_all", "gather", "scatter")
_RECEIVE_ONLY = ("recv", "recv_anysource", "barrier", "monitored_barrier")


def _kind(op: str) -> str:
    if "allgather" in op or "all_gather" in op:
        return "all-gather"
    if "reduce_scatter" in op:
        return "reduce-scatter"
    if "allreduce" in op:
        return "all-reduce"
    return op


@contextmanager
def recording():
    """Record the process-group calls made inside the block (this rank): [kind, bytes this rank contributes,
    the group's global ranks]. An all-gather's contribution is its input (not the gathered output), a
    reduce-scatter's its whole input, an all-reduce's its tensor."""
    from torch._C._distributed_c10d import ProcessGroup

    calls: list[list] = []
    originals = {name: getattr(ProcessGroup, name) for name in probe._methods(ProcessGroup)}
    originals = {name: fn for name, fn in originals.items() if not isinstance(fn, type)}

    def wrap(name, original):
        def recorded(self, *args, **kwargs):
            if name in _RECEIVE_ONLY:
                given = ()
            elif name.startswith(_OUTPUT_FIRST):
                given = args[1:2]  # (the output comes first)
            else:
                given = args[:1]
            nbytes = sum(t.numel() * t.element_size() for t in probe._tensors(list(given)))
            try:
                group = sorted(dist.get_process_group_ranks(self))
            except (RuntimeError, ValueError, KeyError):
                group = []  # a group torch does not know
            calls.append([_kind(name), int(nbytes), group])
            return original(self, *args, **kwargs)

        return recorded

    with probe.wrapped(ProcessGroup, originals, wrap):
        yield calls


def _shown(calls: list[list], limit: int = 4) -> str:
    def one(c):
        size = "" if c[1] is None else f" ({c[1]} bytes from the rank)"
        return f"{c[0]}{size}" + (f" over ranks {c[2]}" if len(c) > 2 and c[2] is not None else "")

    text = ", ".join(one(c) for c in calls[:limit])
    return (text or "nothing") + (" ..." if len(calls) > limit else "")


def _matches(call: list, expected: list) -> bool:
    """A call against an expected [kind, bytes or None (any), group or None (any)]."""
    return len(call) == len(expected) and all(e is None or c == e for c, e in zip(call, expected, strict=True))


def calls_line(what: str, ranks_calls: list[list[list]], expected: list[list], each: bool = False) -> str:
    """One verdict line: every rank made exactly the calls `expected` (each: expected[r] for rank r; in order; None
    matches anything); else the first rank that did not, what it made and what was expected."""
    for r, calls in enumerate(ranks_calls):
        mine = expected[r] if each else expected
        if len(calls) != len(mine) or not all(map(_matches, calls, mine)):
            return f"{what}: rank {r} made {_shown(calls)}, expected {_shown(mine)}: FAIL"
    return f"{what}: PASS"


def ranks_line(what: str, got: list, expected: list) -> str:
    """One verdict line for a value every rank returns: the first rank that differs from one device is named."""
    for r, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        verdict = compare(f"{what}: rank {r}", ours, theirs)
        if not verdict.passed:
            return verdict.line
    return compare(what, got, expected).line


def _first_wrong(what: str, cases: dict[str, tuple[list, list]]) -> str:
    """ranks_line over several cases ({case: (each rank's value, each rank's expected value)}): the first case and
    rank that differ are named."""
    for case, (got, expected) in cases.items():
        line = ranks_line(f"{what}: {case}", got, expected)
        if line.endswith("FAIL"):
            return line
    return compare(what, [g for g, _ in cases.values()], [e for _, e in cases.values()]).line


def _library(ranks: list[dict]) -> list[str]:
    return sorted({name for res in ranks for name in res["library"]})


def _library_line(what: str, ranks: list[dict]) -> str:
    return library_line(what, _library(ranks), "the library's tensor- or sequence-parallel code")


def _p2p_recording():
    """parlab.core.probe's recorder, each call as [op, bytes of the tensor sent or received, peer]."""

    @contextmanager
    def recorder():
        calls: list[list] = []
        with probe.recording(keep_sent_data=False) as made:
            yield calls
        calls.extend([c["op"], int(c["bytes"]), int(c["peer"])] for c in made)

    return recorder()


def _through(op, inp: torch.Tensor, loss_of) -> dict:
    """Rank code: out = op(inp) and loss_of(out).backward(), each direction recorded (op, bytes, peer) and guarded.
    A hook on out keeps the gradient autograd hands to op's backward, with a copy taken when it arrived: op must not
    change it."""
    incoming = []  # (dL/d(op's output) as autograd passes it on, a copy taken when it arrived)
    with _p2p_recording() as forward, library_calls(LIBRARY) as called:
        out = op(inp)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(lambda grad: incoming.append((grad, grad.detach().clone())))
    with _p2p_recording() as backward, library_calls(LIBRARY) as called_backward:
        loss_of(out).backward()
    changed = None  # None: op's backward was never reached
    if incoming:
        seen, copy = incoming[0]
        changed = float((seen.detach() - copy).abs().max())
    return {
        "out": out.detach() if isinstance(out, torch.Tensor) else None,
        "grad": inp.grad,
        "forward": forward,
        "backward": backward,
        "incoming_changed": changed,
        "library": [*called, *called_backward],
    }


def _incoming_line(what: str, cases: dict[str, list[dict]]) -> str:
    """autograd's incoming gradient unchanged by the backward, on every rank of every case."""
    what = f"{what}: autograd's incoming gradient left unchanged on every rank"
    for case, ranks in cases.items():
        where = f"{case}, " if case else ""
        for r, res in enumerate(ranks):
            change = res["incoming_changed"]
            if change is None:
                return f"{what}: {where}rank {r}: the backward was never reached (the output needs autograd): FAIL"
            if change != 0.0:
                return (
                    f"{what}: {where}rank {r}: it was overwritten in place (max change {change:.2g}; expected "
                    "unchanged: autograd may hand the same tensor to other nodes): FAIL"
                )
    return f"{what}: PASS"


# ---------------------------------------------------------------------------------------------- the conjugates


def conjugates_problem(seed: int = 0) -> dict[str, torch.Tensor]:
    """The sequence-parallel pair, on SEQ tokens: s [B, SEQ, H] (the tokens, dealt by a layout), Gs [P, B, SEQ, H]
    (rank r's own dL/d(whole sequence): a partial, as a tensor-parallel region leaves it), u [P, B, SEQ, H] (rank r's
    partial sums for scatter_tokens) and Gu [B, SEQ, H] = dL/d(the summed tokens)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"s": (BATCH, SEQ, H), "gs": (P, BATCH, SEQ, H), "u": (P, BATCH, SEQ, H), "gu": (BATCH, SEQ, H)}
    return {name: _randn(gen, *shape) for name, shape in shapes.items()}


def run_conjugates(gather_tokens, scatter_tokens) -> dict:
    """Rank code: for each layout, gather_tokens on this rank's tokens and scatter_tokens on this rank's partial
    sums."""
    r, out = dist.get_rank(), {}
    data = _on_device(conjugates_problem())
    for name, layout in LAYOUTS.items():
        mine = _tokens(layout, r)
        out[f"gather {name}"] = _through(
            lambda x, layout=layout: gather_tokens(x, layout),
            data["s"][:, mine].clone().requires_grad_(),  # [B, n_r, H]: this rank's tokens
            lambda y: (y * data["gs"][r]).sum(),
        )
        out[f"scatter {name}"] = _through(
            lambda z, layout=layout: scatter_tokens(z, layout),
            data["u"][r].clone().requires_grad_(),  # [B, SEQ, H]: this rank's partial sums
            lambda y, mine=mine: (y * data["gu"][:, mine]).sum(),
        )
    return out


def collect_conjugates(gather_tokens, scatter_tokens) -> dict:
    return {"ranks": list(parlab.launch(run_conjugates, P, gather_tokens, scatter_tokens, **LAUNCH))}


def _off_ring(calls: list, r: int, ranks: int) -> str:
    """'' when every call ([op, peer]) rank r made is a send or a receive with a ring neighbour (r - 1 or r + 1 of
    `ranks`); else what the first other one was, as it follows "rank r" in a FAIL line."""
    neighbours = {(r - 1) % ranks, (r + 1) % ranks}
    for op, peer in calls:
        if op not in probe.P2P:
            return f" called {op}, expected sends and receives only"
        if peer not in neighbours:
            return f": a {op} with rank {peer}, expected only ranks {sorted(neighbours)}"
    return ""


def _sp_calls_line(what: str, cases: dict[str, list[list]], moved: str) -> str:
    """Every rank of every case (case: each rank's [op, bytes, peer] calls) made sends and receives only, each with a
    ring neighbour, and `moved` ("received" or "sent") exactly B (T - n_r) H float64 numbers: the tokens it does not
    hold, each once, no padding."""
    for case, ranks_calls in cases.items():
        layout = LAYOUTS[case]
        for r, calls in enumerate(ranks_calls):
            if wrong := _off_ring([(op, peer) for op, _, peer in calls], r, P):
                return f"{what}: {case}, rank {r}{wrong}: FAIL"
            op = "send" if moved == "sent" else "recv"
            got = sum(nbytes for kind, nbytes, _ in calls if kind.startswith(op))
            expected = BATCH * (SEQ - len(layout[r])) * H * 8
            if got != expected:
                return f"{what}: {case}, rank {r} {moved} {got} bytes, expected {expected}: FAIL"
    return f"{what}: PASS"


def judge_conjugates(data) -> list[str]:
    ranks, ref = data["ranks"], conjugates_problem()  # host: the reference on one device
    summed_gs, summed_u = ref["gs"].sum(0), ref["u"].sum(0)  # [B, SEQ, H]: over the ranks
    gathers = {name: [res[f"gather {name}"] for res in ranks] for name in LAYOUTS}
    scatters = {name: [res[f"scatter {name}"] for res in ranks] for name in LAYOUTS}

    def tokens_of(t: torch.Tensor, layout, r: int) -> torch.Tensor:
        return t[:, layout[r]]

    lines = [
        _first_wrong(
            "gather_tokens: the whole sequence, in order, on every rank",
            {name: ([res["out"] for res in gathers[name]], [ref["s"]] * P) for name in LAYOUTS},
        ),
        _first_wrong(
            "gather_tokens backward: each rank's tokens of dL/d(sequence) summed over the ranks",
            {
                name: ([res["grad"] for res in gathers[name]], [tokens_of(summed_gs, layout, r) for r in range(P)])
                for name, layout in LAYOUTS.items()
            },
        ),
        _sp_calls_line(
            "gather_tokens forward: ring neighbours only, each rank receiving exactly B (T - n_r) H numbers",
            {name: [res["forward"] for res in gathers[name]] for name in LAYOUTS},
            "received",
        ),
        _sp_calls_line(
            "gather_tokens backward: ring neighbours only, each rank sending exactly B (T - n_r) H numbers",
            {name: [res["backward"] for res in gathers[name]] for name in LAYOUTS},
            "sent",
        ),
        _incoming_line("gather_tokens backward", gathers),
        _first_wrong(
            "scatter_tokens: each rank's tokens of the ranks' sum",
            {
                name: ([res["out"] for res in scatters[name]], [tokens_of(summed_u, layout, r) for r in range(P)])
                for name, layout in LAYOUTS.items()
            },
        ),
        _first_wrong(
            "scatter_tokens backward: dL/d(sequence) on every rank",
            {name: ([res["grad"] for res in scatters[name]], [ref["gu"]] * P) for name in LAYOUTS},
        ),
        _sp_calls_line(
            "scatter_tokens forward: ring neighbours only, each rank sending exactly B (T - n_r) H numbers",
            {name: [res["forward"] for res in scatters[name]] for name in LAYOUTS},
            "sent",
        ),
        _sp_calls_line(
            "scatter_tokens backward: ring neighbours only, each rank receiving exactly B (T - n_r) H numbers",
            {name: [res["backward"] for res in scatters[name]] for name in LAYOUTS},
            "received",
        ),
        _incoming_line("scatter_tokens backward", scatters),
        _library_line(
            "the conjugates", [{"library": [c for part in res.values() for c in part["library"]]} for res in ranks]
        ),
    ]
    return lines


# ------------------------------------------------------------------------------- the lab model's SwiGLU MLP


def swiglu_problem(seed: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """The lab model's first MLP (parlab.core.lab_model.SwiGLU, H -> F -> H, no biases): gate and up [F, H], down
    [H, F]; x: [B, seq, H], the whole sequence (rank r is handed its tokens of it)."""
    mlp = build_lab_model(MLP_CFG, seed).blocks[0].mlp  # host: the problem's data; rank code moves it (_on_device)
    gen = torch.Generator().manual_seed(seed + 10)
    return {
        "gate": mlp.gate.weight.detach().clone(),  # [F, H]
        "up": mlp.up.weight.detach().clone(),  # [F, H]
        "down": mlp.down.weight.detach().clone(),  # [H, F]
        "x": _randn(gen, BATCH, seq, MLP_CFG.hidden),
    }


def reference_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One device: the lab model's SwiGLU, silu(x gate^T) * (x up^T) down^T."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def forward_watched(swiglu, data: dict[str, torch.Tensor], layout: list[list[int]]) -> dict:
    """Rank code: the student's forward on this rank's tokens, watched (Watch), every call into torch.distributed
    recorded, guarded; no autograd (a prefill)."""
    r = dist.get_rank()
    x = data["x"][:, _tokens(layout, r)].clone()  # [B, n_r, H]: this rank's tokens
    gate, up, down = data["gate"], data["up"], data["down"]
    watch = Watch([x, gate, up, down], gate, up, down)
    since = time.perf_counter()
    with torch.no_grad(), probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as called:
        with watch:
            y = swiglu(x, gate, up, down, layout)
    return {
        "y": y.detach() if isinstance(y, torch.Tensor) else None,
        "calls": [[c["op"], int(c["peer"])] for c in calls],
        "transfers": p2p_events(since),
        "gemms": watch.gemms,
        "units": {name: sorted(units) for name, units in watch.units.items()},
        "largest": watch.largest,
        "peak": watch.peak,
        "library": list(called),
    }


def _tokens_in(layout: list[list[int]]) -> int:
    return sum(map(len, layout))


def run_swiglu(swiglu, cases: dict[str, list[list[int]]]) -> dict:
    """Rank code, for each case (all on this many ranks): the student's forward on this rank's tokens."""
    return {
        name: forward_watched(swiglu, _on_device(swiglu_problem(seq=_tokens_in(layout))), layout)
        for name, layout in cases.items()
    }


def collect_swiglu(swiglu) -> dict:
    """The cases on 4 ranks in one launch, the 8-rank case in another: {case: every rank's result}."""
    out = {}
    for ranks in sorted({len(layout) for layout in SWIGLU_CASES.values()}):
        cases = {name: layout for name, layout in SWIGLU_CASES.items() if len(layout) == ranks}
        results = list(parlab.launch(run_swiglu, ranks, swiglu, cases, **LAUNCH))
        out.update({name: [res[name] for res in results] for name in cases})
    return {"cases": out}


def _ring_line(what: str, cases: dict[str, list[dict]]) -> str:
    """Point-to-point messages only, one way round the ring: each rank sends to one neighbour only (r - 1 or r + 1)
    and receives from the other only."""
    for case, ranks in cases.items():
        for r, res in enumerate(ranks):
            if wrong := _off_ring(res["calls"], r, len(ranks)):
                return f"{what}: {case}, rank {r}{wrong}: FAIL"
            peers = {"send": set(), "recv": set()}
            for op, peer in res["calls"]:
                peers["send" if op == "send" else "recv"].add(peer)
            if len(peers["send"]) > 1 or len(peers["recv"]) > 1 or peers["send"] & peers["recv"]:
                return (
                    f"{what}: {case}, rank {r} sent to ranks {sorted(peers['send'])} and received from ranks "
                    f"{sorted(peers['recv'])}, expected sends to one neighbour and receives from the other: FAIL"
                )
    return f"{what}: PASS"


def _traced_line(what: str, cases: dict[str, list[dict]]) -> str:
    """Every send and receive through parlab.core.comm (its trace is what the overlap check reads)."""
    for case, ranks in cases.items():
        for r, res in enumerate(ranks):
            made = sum(op in probe.P2P for op, _ in res["calls"])
            traced = len(res["transfers"])
            if made != traced:
                return (
                    f"{what}: {case}, rank {r} made {made} sends and receives, {traced} of them through "
                    "parlab.core.comm: FAIL"
                )
    return f"{what}: PASS"


def _memory_line(what: str, cases: dict[str, tuple[list[dict], int]]) -> str:
    """No tensor the forward made (views of what it was handed aside) holds more than `limit` numbers."""
    for case, (ranks, limit) in cases.items():
        for r, res in enumerate(ranks):
            big = res["largest"]
            if big["numbers"] > limit:
                return (
                    f"{what}: {case}, rank {r}'s {big['call']} made a tensor {big['shape']} holding {big['numbers']} "
                    f"numbers, expected at most {limit}: FAIL"
                )
    return f"{what}: PASS"


def _held_line(what: str, cases: dict[str, tuple[list[dict], int]]) -> str:
    """What the forward holds at once (every storage one of its tensors still alive uses) stays within `limit`."""
    for case, (ranks, limit) in cases.items():
        for r, res in enumerate(ranks):
            peak = res["peak"]
            if peak["numbers"] > limit:
                return (
                    f"{what}: {case}, rank {r} held {peak['numbers']} numbers in {peak['tensors']} tensors at once "
                    f"(after a {peak['call']}), expected at most {limit}: FAIL"
                )
    return f"{what}: PASS"


def _units_line(what: str, cases: dict[str, list[dict]], F_: int) -> str:
    """Each rank's GEMMs use the gate rows, up rows and down columns of the same F/P units; no unit on two ranks."""
    for case, ranks in cases.items():
        owner: dict[int, int] = {}
        P = len(ranks)
        for r, res in enumerate(ranks):
            used = res["units"]
            counts = ", ".join(f"{name} {len(used[name])}" for name in ("gate", "up", "down"))
            if not used["gate"] == used["up"] == used["down"] or len(used["gate"]) != F_ // P:
                return (
                    f"{what}: {case}, rank {r}'s GEMMs used the weights of units: {counts}; expected the same "
                    f"F/P = {F_ // P} units in gate, up and down: FAIL"
                )
            taken = [u for u in used["gate"] if u in owner]
            if taken:
                return f"{what}: {case}, rank {r} used {len(taken)} units that rank {owner[taken[0]]} used too: FAIL"
            owner.update(dict.fromkeys(used["gate"], r))
    return f"{what}: PASS"


def _work_line(what: str, cases: dict[str, list[dict]], share) -> str:
    """Every rank's GEMMs, in multiply-adds, add up to its share (share(case, ranks)): every token through its
    units, once."""
    for case, ranks in cases.items():
        expected = share(case, len(ranks))
        for r, res in enumerate(ranks):
            work = sum(g["work"] for g in res["gemms"])
            if work != expected:
                return f"{what}: {case}, rank {r}'s GEMMs did {work} multiply-adds, expected {expected}: FAIL"
    return f"{what}: PASS"


def _overlap_wrong(res: dict) -> str:
    """'' when every receive but the rank's last (the last issued) was in flight while a GEMM computed (issued before
    it began, waited for after it ended); else the first that was not. A rank that receives nothing fails."""
    gemms = res["gemms"]
    receives = sorted((t for t in res["transfers"] if t["kind"] == "recv"), key=lambda t: t["start"])
    if not receives:
        return "no receive at all (nothing travelled to hide)"
    for i, e in enumerate(receives[:-1]):
        end = math.inf if e["end"] < 0 else e["end"]
        if not any(e["start"] <= g["start"] and g["end"] <= end for g in gemms):
            return f"receive {i} (from rank {e['peer']}, {e['bytes']} bytes) waited for with no GEMM while in flight"
    return ""


def _overlap_line(what: str, cases: dict[str, list[dict]]) -> str:
    for case, ranks in cases.items():
        for r, res in enumerate(ranks):
            if wrong := _overlap_wrong(res):
                return f"{what}: {case}, rank {r}: {wrong}, expected a GEMM computing meanwhile: FAIL"
    return f"{what}: PASS"


def judge_swiglu(data) -> list[str]:
    cases = data["cases"]
    B, H, F_ = BATCH, MLP_CFG.hidden, MLP_CFG.ffn
    block = {name: B * max(map(len, layout)) * H for name, layout in SWIGLU_CASES.items()}  # B max(n_r) H numbers
    expected = {}
    for name, layout in SWIGLU_CASES.items():
        ref = swiglu_problem(seq=_tokens_in(layout))  # host: the reference on one device
        y = reference_mlp(ref["x"], ref["gate"], ref["up"], ref["down"])  # [B, T, H]
        expected[name] = [y[:, tokens] for tokens in layout]
    every = [{"library": [c for ranks in cases.values() for res in ranks for c in res["library"]]}]
    return [
        _first_wrong(
            "y: each rank's tokens of the MLP's output",
            {name: ([res["y"] for res in ranks], expected[name]) for name, ranks in cases.items()},
        ),
        _ring_line("communication: sends and receives only, one way round the ring of neighbours", cases),
        _traced_line("every send and receive through parlab.core.comm", cases),
        _memory_line(
            f"memory: no tensor made holds more than {TENSOR_BLOCKS} B max(n_r) H numbers",
            {name: (ranks, TENSOR_BLOCKS * block[name]) for name, ranks in cases.items()},
        ),
        _held_line(
            f"memory: at most {LIVE_BLOCKS} B max(n_r) H numbers held at once, whatever P",
            {name: (ranks, LIVE_BLOCKS * block[name]) for name, ranks in cases.items()},
        ),
        _units_line(
            "the work split by units: each rank its own F/P units' gate and up rows and down columns", cases, F_
        ),
        _work_line(
            "the work not repeated: each rank's GEMMs, 3 B T H F/P multiply-adds",
            cases,
            lambda name, P: 3 * B * _tokens_in(SWIGLU_CASES[name]) * H * F_ // P,
        ),
        _overlap_line("overlap: every receive but each rank's last in flight while a GEMM computes", cases),
        _library_line("the SwiGLU MLP", every),
    ]


def _region_calls(layout_name, nbytes: int, ranks: list[dict]) -> tuple[list[list], list[list]]:
    """The calls each rank's region operators make (forward, backward), one list per rank: f and g's all-reduces of
    [B, T, H] over every rank; or what the sequence-parallel pair made on that rank when run alone, enter then leave
    (its calls are part 1's business: here they must come once each way, and nothing else)."""
    everyone = list(range(P))
    if layout_name is None:
        return [[["all-reduce", nbytes, everyone]]] * P, [[["all-reduce", nbytes, everyone]]] * P
    return [res["region_forward"] for res in ranks], [res["region_backward"] for res in ranks]


def _region_words(layout_name, nbytes: int) -> str:
    if layout_name is None:
        return f"one all-reduce of [B, T, H] ({nbytes} bytes)"
    return "the calls enter and leave make when run alone, once each"


# ----------------------------------------------------------------------- grouped-query attention, nkv < P


def gqa_problem(cfg: LabConfig, seed: int = 3) -> dict[str, torch.Tensor]:
    """x: [B, SEQ, H] and G = dL/dy: [B, SEQ, H] (in sequence order) for the attention of the lab model built from
    `cfg`."""
    gen = torch.Generator().manual_seed(seed)
    return {"x": _randn(gen, BATCH, SEQ, cfg.hidden), "g": _randn(gen, BATCH, SEQ, cfg.hidden)}


def row_order(order, layout_name) -> list[int]:
    """The sequence index of each row the attention sees, in its order."""
    if order is None:
        return list(range(SEQ))
    if order == "ranks":
        return [t for tokens in LAYOUTS[layout_name] for t in tokens]
    return list(order)


def doc_attention(attn, x: torch.Tensor, positions: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """One device: the lab model's attention on a packed sequence, x [B, T, H] in any row order, positions and docs
    [T] those of its rows: RoPE by each row's position, each row attending to its own document's rows at positions up
    to its own."""
    cfg, (B, T, _) = attn.cfg, x.shape
    hd = cfg.head_size

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, n hd] -> [B, n, T, hd]
        return t.view(B, T, -1, hd).transpose(1, 2)

    q = apply_rope(heads(attn.q(x)), positions, cfg.rope_base)  # [B, nq, T, hd]
    k = apply_rope(heads(attn.k(x)), positions, cfg.rope_base).repeat_interleave(cfg.group_size, dim=1)
    v = heads(attn.v(x)).repeat_interleave(cfg.group_size, dim=1)  # [B, nq, T, hd]
    seen = (docs[:, None] == docs[None, :]) & (positions[None, :] <= positions[:, None])  # [T query, T key]
    scores = (q @ k.transpose(-2, -1) / hd**0.5).masked_fill(~seen, float("-inf"))
    y = scores.softmax(dim=-1) @ v  # [B, nq, T, hd]
    return attn.o(y.transpose(1, 2).reshape(B, T, -1))


def _gqa_regions(layout_name, order, f, g, gather_tokens, scatter_tokens):
    """The region's operators as the attention sees them: f and g, or the sequence-parallel pair with the rows in
    the ranks' order (the gathered sequence read in that order; leave puts each row back in its place first)."""
    if layout_name is None:
        return f, g
    layout, rows = LAYOUTS[layout_name], row_order(order, layout_name)
    back = torch.tensor(rows).argsort().tolist()  # host: an index list; back[t] is the row holding token t

    def enter(x):
        return gather_tokens(x, layout)[:, rows]

    def leave(y):
        return scatter_tokens(y[:, back], layout)

    return enter, leave


def run_gqa(module_class, f, g, gather_tokens, scatter_tokens) -> dict:
    """Rank code, for each case: the student's module built from the lab model's full attention (the same on every
    rank) and the region's operators, its forward on x (whole, rows in the case's order; or this rank's tokens) with
    the positions and documents of the rows enter returns, the backward of sum(y * G), then its gradient sync."""
    r, out = dist.get_rank(), {}
    for name, (cfg, (where, docs), layout_name, order) in GQA_CASES.items():
        full = build_lab_model(cfg, seed=3, device=parlab.device()).blocks[0].attn
        data = _on_device(gqa_problem(cfg))
        rows = row_order(order, layout_name)
        mine = _tokens(LAYOUTS[layout_name], r) if layout_name else torch.tensor(rows, device=parlab.device())
        x = data["x"][:, mine].clone().requires_grad_()
        positions = torch.tensor(where, device=parlab.device())[rows]  # [SEQ]: those of the rows enter returns
        documents = torch.tensor(docs, device=parlab.device())[rows]  # [SEQ]
        enter, leave = _gqa_regions(layout_name, order, f, g, gather_tokens, scatter_tokens)
        region_forward, region_backward, called_region = [], [], []
        if layout_name is not None:  # the region's operators alone, enter then leave: the calls they make
            with recording() as region_forward, library_calls(LIBRARY) as called_region:
                alone = leave(enter(x.detach().clone().requires_grad_()))
            with recording() as region_backward, library_calls(LIBRARY) as called_region_backward:
                (alone * data["g"][:, mine]).sum().backward()
            called_region = [*called_region, *called_region_backward]
        with library_calls(LIBRARY) as called_init:
            module = module_class(full, enter, leave)
        with recording() as forward_calls, library_calls(LIBRARY) as called:
            y = module(x, positions, documents)
        with recording() as backward_calls, library_calls(LIBRARY) as called_backward:
            (y * data["g"][:, mine]).sum().backward()
        with recording() as sync_calls, library_calls(LIBRARY) as synced:
            module.sync_grads()
        weights = {w: getattr(module, w).weight for w in ("q", "k", "v", "o")}
        out[name] = {
            "y": y.detach(),
            "grad_x": x.grad,
            "weights": {w: t.detach() for w, t in weights.items()},
            "grads": {w: t.grad for w, t in weights.items()},
            "forward": forward_calls,
            "backward": backward_calls,
            "sync": sync_calls,
            "region_forward": region_forward,
            "region_backward": region_backward,
            "library": [*called_region, *called_init, *called, *called_backward, *synced],
        }
    return out


def collect_gqa(module_class, f, g, gather_tokens, scatter_tokens) -> dict:
    return {"ranks": list(parlab.launch(run_gqa, P, module_class, f, g, gather_tokens, scatter_tokens, **LAUNCH))}


def gqa_reference(cfg: LabConfig, where: list[int], docs: list[int]) -> dict:
    """One device, in sequence order: y, dL/dx and every weight's gradient and value of the attention."""
    attn = build_lab_model(cfg, seed=3).blocks[0].attn
    data = gqa_problem(cfg)
    x = data["x"].clone().requires_grad_()
    y = doc_attention(attn, x, torch.tensor(where), torch.tensor(docs))  # host: the reference on one device
    (y * data["g"]).sum().backward()
    return {
        "y": y.detach(),
        "grad_x": x.grad,
        "weights": {w: getattr(attn, w).weight.detach() for w in ("q", "k", "v", "o")},
        "grads": {w: getattr(attn, w).weight.grad for w in ("q", "k", "v", "o")},
    }


def _rows_of(held: torch.Tensor | None, full: torch.Tensor) -> list[int] | None:
    """Which rows of `full` [n, H] the rows of `held` [m, H] are copies of (None if one of them is no such copy)."""
    if held is None or held.dim() != 2 or held.shape[1] != full.shape[1]:
        return None
    rows = []
    for row in held.cpu():
        same = (full == row).all(dim=1).nonzero().flatten()
        if len(same) == 0:
            return None
        rows.append(int(same[0]))
    return rows


def _weights_line(name: str, cfg: LabConfig, ranks: list[dict], ref: dict) -> str:
    """q and o hold this rank's query heads; k and v hold copies of rows of the full k and v, at most hd each."""
    hd, per_rank = cfg.head_size, cfg.heads // P
    what = f"{name}: weights: q and o this rank's query heads, k and v rows of the full ones, at most hd = {hd} each"
    for r, res in enumerate(ranks):
        mine = slice(r * per_rank * hd, (r + 1) * per_rank * hd)
        for w, expected in (("q", ref["weights"]["q"][mine]), ("o", ref["weights"]["o"][:, mine])):
            held = res["weights"][w]
            if held.shape != expected.shape:
                return f"{what}: rank {r}'s {w}.weight is {list(held.shape)}, expected {list(expected.shape)}: FAIL"
            if held.dtype != expected.dtype:
                return f"{what}: rank {r}'s {w}.weight is {held.dtype}, expected {expected.dtype}: FAIL"
            if not torch.equal(held.cpu(), expected):
                wrong = (held.cpu() != expected).nonzero()[0].tolist()
                return (
                    f"{what}: rank {r}'s {w}.weight{wrong} is {float(held.cpu()[tuple(wrong)]):.6g}, expected "
                    f"{float(expected[tuple(wrong)]):.6g} (a copy of the full weight's): FAIL"
                )
        for w in ("k", "v"):
            held = res["weights"][w]
            if held.dtype != ref["weights"][w].dtype:
                return f"{what}: rank {r}'s {w}.weight is {held.dtype}, expected {ref['weights'][w].dtype}: FAIL"
            if _rows_of(held, ref["weights"][w]) is None:
                return f"{what}: rank {r}'s {w}.weight {list(held.shape)} is not made of rows of the full {w}: FAIL"
            if held.shape[0] > hd:
                return f"{what}: rank {r}'s {w}.weight holds {held.shape[0]} rows, expected at most {hd}: FAIL"
    return f"{what}: PASS"


def _grads_line(what: str, ranks: list[dict], ref: dict, cfg: LabConfig, names: tuple[str, ...]) -> str:
    """The first rank and weight whose gradient differs from one device's gradient of the rows it holds."""
    hd, per_rank = cfg.head_size, cfg.heads // P
    got, expected = [], []
    for r, res in enumerate(ranks):
        mine = slice(r * per_rank * hd, (r + 1) * per_rank * hd)
        for w in names:
            if w in ("q", "o"):
                exp = ref["grads"]["q"][mine] if w == "q" else ref["grads"]["o"][:, mine]
            else:
                rows = _rows_of(res["weights"][w], ref["weights"][w])
                exp = ref["grads"][w][rows] if rows is not None else ref["grads"][w][:hd]
            verdict = compare(f"{what}: rank {r}, {w}.weight", res["grads"][w], exp)
            if not verdict.passed:
                return verdict.line
            got.append(res["grads"][w])
            expected.append(exp)
    return compare(what, got, expected).line


def _sync_line(name: str, cfg: LabConfig, ranks: list[dict]) -> str:
    """sync_grads: all-reduces only, each rank contributing at most 2 hd H float64 numbers in all."""
    limit = 2 * cfg.head_size * cfg.hidden * 8
    what = f"{name}: sync_grads: all-reduces only, each rank contributing at most {limit} bytes (2 hd H numbers)"
    for r, res in enumerate(ranks):
        for call in res["sync"]:
            if call[0] != "all-reduce":
                return f"{what}: rank {r} made {_shown([call], 1)}, expected all-reduces only: FAIL"
        sent = sum(call[1] for call in res["sync"])
        if sent > limit:
            return f"{what}: rank {r} contributed {sent} bytes ({_shown(res['sync'])}), expected at most {limit}: FAIL"
    return f"{what}: PASS"


def judge_gqa(data) -> list[str]:
    lines = []
    for name, (cfg, (where, docs), layout_name, order) in GQA_CASES.items():
        ranks = [res[name] for res in data["ranks"]]
        ref = gqa_reference(cfg, where, docs)
        rows = row_order(order, layout_name)
        mine = [LAYOUTS[layout_name][r] if layout_name else rows for r in range(P)]
        activation = BATCH * SEQ * cfg.hidden * 8
        forward, backward = _region_calls(layout_name, activation, ranks)
        words = _region_words(layout_name, activation)
        tokens = "each rank's tokens" if layout_name else "every rank, in the rows' order"
        lines += [
            ranks_line(f"{name}: y, {tokens}", [res["y"] for res in ranks], [ref["y"][:, m] for m in mine]),
            ranks_line(
                f"{name}: dL/dx, {tokens}", [res["grad_x"] for res in ranks], [ref["grad_x"][:, m] for m in mine]
            ),
            _weights_line(name, cfg, ranks, ref),
            _grads_line(f"{name}: dL/dW of q and o", ranks, ref, cfg, ("q", "o")),
            _grads_line(
                f"{name}: dL/dW of k and v after sync_grads, the rows each rank holds", ranks, ref, cfg, ("k", "v")
            ),
            calls_line(
                f"{name}: forward, every rank: {words}, nothing else",
                [res["forward"] for res in ranks],
                forward,
                each=True,
            ),
            calls_line(
                f"{name}: backward, every rank: {words}, nothing else",
                [res["backward"] for res in ranks],
                backward,
                each=True,
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
    with recording() as forward_calls, library_calls(LIBRARY) as called:
        loss = loss_fn.apply(z, targets.clone(), r * k)
    with recording() as backward_calls, library_calls(LIBRARY) as called_backward:
        loss.backward()
    return {
        "loss": loss.detach(),
        "grad": z.grad,
        "forward": forward_calls,
        "backward": backward_calls,
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
    limit = 2 * BATCH * T * 8  # bytes: 2 float64 numbers per row, what one rank may contribute
    what = "forward, every rank: one call into torch.distributed, contributing at most 2 numbers per row"
    verdict = f"{what}: PASS"
    for r, res in enumerate(ranks):
        calls = res["forward"]
        if len(calls) != 1 or calls[0][1] > limit:
            verdict = (
                f"{what}: rank {r} made {_shown(calls, 3)}, expected one call to which each rank contributes at "
                f"most {limit} bytes: FAIL"
            )
            break
    return [
        ranks_line("loss on every rank", [res["loss"] for res in ranks], [loss.detach()] * P),
        compare("dL/dlogits, the ranks' columns side by side", grad, logits.grad).line,
        verdict,
        calls_line("backward, every rank: no communication", [res["backward"] for res in ranks], []),
        _library_line("the loss", ranks),
    ]


# ----------------------------------------------------------------------- prediction: part 2's ring, uneven


def ring_layout(counts: list[int] = RING_COUNTS) -> list[list[int]]:
    """Rank r holds the next counts[r] tokens of the sequence."""
    starts = [sum(counts[:r]) for r in range(len(counts))]
    return [list(range(s, s + n)) for s, n in zip(starts, counts, strict=True)]


def layer_theory(
    cfg: LabConfig = RING_CFG, batch: int = RING_BATCH, counts: list[int] = RING_COUNTS
) -> dict[str, float]:
    """Part 2's MLP forward on len(counts) ranks, rank r holding counts[r] tokens, float64; bytes over the busiest
    link between ring neighbours, in one direction.

    link_bytes: x blocks and partial sums travel the same way round the ring (from each rank a to its next rank b),
    each over the fewest links that serve it. Rank j's x block must reach the P - 1 others: it crosses every link but
    the one into rank j. Block j's partial sum must collect every other rank's share and end on rank j: it starts on
    the rank after j and crosses every link but the one out of rank j. The link a -> b thus carries every x block
    but b's and every partial sum but a's: B H e (2 T - n_a - n_b), the busiest between the two neighbours that hold
    the fewest tokens together.

    padded_link_bytes: the same forward in Megatron-SP form as the library runs it (an all-gather of blocks padded to
    the largest rank's count, then the reduce-scatter of P such blocks), both ring collectives: each link carries
    P - 1 padded blocks in each."""
    e, P_, T_ = cfg.dtype_bytes, len(counts), sum(counts)
    pair = min(counts[r] + counts[(r + 1) % P_] for r in range(P_))  # neighbours, either way round
    return {
        "link_bytes": batch * cfg.hidden * e * (2 * T_ - pair),
        "padded_link_bytes": 2 * (P_ - 1) * batch * max(counts) * cfg.hidden * e,
    }


THEORY = {"layer_bytes": layer_theory}


def plain(value) -> float | str:
    """A prediction as plain data for the grader: a float, or (what cannot be one) a short text."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def ring_problem(seed: int = 7) -> dict[str, torch.Tensor]:
    """RING_CFG's first MLP and x: [RING_BATCH, T, H]."""
    mlp = build_lab_model(RING_CFG, seed).blocks[0].mlp  # host: the problem's data; rank code moves it
    gen = torch.Generator().manual_seed(seed + 10)
    return {
        "gate": mlp.gate.weight.detach().clone(),
        "up": mlp.up.weight.detach().clone(),
        "down": mlp.down.weight.detach().clone(),
        "x": _randn(gen, RING_BATCH, RING_CFG.seq_len, RING_CFG.hidden),
    }


def run_ring(swiglu) -> dict:
    """Rank code: the student's part 2 at the prediction's size."""
    res = forward_watched(swiglu, _on_device(ring_problem()), ring_layout())
    return {"y": res["y"], "transfers": res["transfers"]}


def collect_layer_bytes(predicted: dict, swiglu=None):
    out = {"predicted": {k: plain(predicted.get(k)) for k in ("link_bytes", "padded_link_bytes")}}
    try:
        out["measured"] = list(parlab.launch(run_ring, RING_P, swiglu, **LAUNCH))
    except Exception as exc:  # part 2 is not done yet: the prediction is scored all the same
        out["measured_error"] = error_summary(exc)[:200]
    return out


def _busiest_link(ranks: list[dict]) -> tuple[int, int, int]:
    """(bytes, from, to) of the link that carried the most bytes one way in a live run."""
    links: dict[tuple[int, int], int] = {}
    for r, res in enumerate(ranks):
        for e in res["transfers"]:
            if e["kind"] == "send":
                links[(r, e["peer"])] = links.get((r, e["peer"]), 0) + e["bytes"]
    if not links:
        return 0, -1, -1
    (a, b), most = max(links.items(), key=lambda item: item[1])
    return most, a, b


def judge_layer_bytes(data) -> list[str]:
    theory, predicted = layer_theory(), data["predicted"]
    labels = {
        "link_bytes": "bytes over the busiest link, one way, part 2's forward",
        "padded_link_bytes": "bytes over the busiest link, one way, the forward in Megatron-SP form",
    }
    lines = []
    for key, label in labels.items():
        lines += prediction_lines(label, predicted[key], theory[key], rtol=0)
    if not lines[-1].endswith(": PASS") or not lines[1].endswith(": PASS"):
        lines.append("your part 2's live run at this size is shown once both predictions are right")
    elif "measured" in data:
        ref = ring_problem()  # host: the reference on one device
        y = reference_mlp(ref["x"], ref["gate"], ref["up"], ref["down"])
        exact = all(
            res["y"] is not None and res["y"].shape == y[:, tokens].shape and torch.allclose(res["y"], y[:, tokens])
            for res, tokens in zip(data["measured"], ring_layout(), strict=True)
        )
        most, a, b = _busiest_link(data["measured"])
        lines.append(
            f"your part 2 at this size ({'exact' if exact else 'not exact'}): its busiest link, rank {a} to rank {b}, "
            f"carried {most:,} bytes"
        )
    else:
        lines.append(f"your part 2 did not run at this size ({data.get('measured_error', '')})")
    return lines
