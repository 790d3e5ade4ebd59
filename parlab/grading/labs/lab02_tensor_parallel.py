"""Lab 02's checks: the conjugate operators of a sequence-parallel region whose tokens are dealt to the ranks by
any layout, uneven included (an all-gather and a reduce-scatter along the sequence, and their backwards; Megatron's
f and g are handed out); the lab model's SwiGLU MLP loaded from a fused checkpoint written by a run with another
tensor-parallel degree and another gate/up arrangement, each rank reading only its own units' rows, in either kind of
region; its grouped-query attention split by heads when there are fewer K/V heads than ranks, at positions that are
not 0..T-1; a vocabulary-parallel cross-entropy in one collective; and a prediction of one lab-model layer's traffic
in Megatron-SP form, on an uneven layout.

Every check runs the student's code on P live ranks, each rank handed the same full problem (float64), and compares
with one device computing the whole thing (parlab.core.lab_model for the MLP and the attention). A recorder sees
every call the code makes into torch.distributed (library calls included, with the group each ran on) and what each
rank *contributes* to it (an all-gather's input, a reduce-scatter's whole input, an all-reduce's tensor), in
forward, in backward and in the gradient sync separately. Calls into the library's own tensor- and
sequence-parallel code (`LIBRARY`) are seen too (parlab/grading/labs/guard.py): the lab asks for the student's own.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.core import comm, probe
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, apply_rope, build_lab_model, rms_norm
from parlab.grading.labs import error_summary, prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line

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
# Part 2: the lab model's SwiGLU MLP, H -> F -> H, from a fused checkpoint written by another run: one file per
# saving rank, its units' gate and up rows arranged by one of two conventions (see FusedCheckpoint).
# F = 48: the 3 saving ranks' 16 units each and the P = 4 ranks' 12 do not line up (rank 1's straddle files 0 and 1).
MLP_CFG = LabConfig(vocab_size=V, seq_len=SEQ, hidden=16, heads=4, kv_heads=2, ffn=48, layers=1)
SWIGLU_CASES = {  # name: (ranks that wrote it, its arrangement, the region's layout: None for a tensor-parallel one)
    "saved by 3 ranks, tensor-parallel region": (3, "[gate; up]", None),
    "saved by 8 ranks, sequence-parallel region (scattered layout)": (8, "interleaved", "scattered"),
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
# The prediction: one layer of the lab model in Megatron-SP form on P ranks, LAYER_BATCH sequences of
# LAYER_CFG.seq_len tokens dealt as LAYER_LAYOUT.
LAYER_CFG = LabConfig(vocab_size=64, seq_len=SEQ, hidden=64, heads=8, kv_heads=2, ffn=128, layers=1)
LAYER_BATCH = 2
LAYER_LAYOUT = LAYOUTS["contiguous"]
LIBRARY = (
    "schemes/tensor_parallel.py",
    "schemes/sequence/sequence_parallel.py",
    "lessons/tensor_parallel.py",
    "lessons/tensor_parallel_memory.py",
    "lessons/sequence_parallel.py",
)

STRUCTURAL = {
    "conjugates": "for three layouts of 10 tokens on 4 ranks (contiguous, striped, scattered: uneven, the order "
    "within a rank given): gather_tokens returns the whole sequence in order on every rank from exactly one "
    "all-gather to which each rank contributes at most B max_r(n_r) H numbers, and its backward gives "
    "each rank its tokens of the gradient summed over ranks from exactly one reduce-scatter of at most P times that; "
    "scatter_tokens the reverse (one reduce-scatter forward, one all-gather backward); every backward leaves "
    "autograd's incoming gradient unchanged; no call into the library's tensor- or sequence-parallel code (f and g "
    "are handed out, not graded)",
    "swiglu": "from a fused checkpoint written as one file per saving rank, by a run of 3 ranks in the [gate; up] "
    "arrangement (a tensor-parallel region, the handed-out f and g; its ranks' shares of F do not line up with "
    "the 4 ranks') and by a run of 8 ranks in the interleaved arrangement (a sequence-parallel region on the "
    "scattered layout, the student's gather_tokens and scatter_tokens), the arrangement given to the student only "
    "as the saving run's code: y and dL/dx on every rank equal one device's lab-model SwiGLU (each rank's tokens "
    "in the sequence-parallel region); the work split, not repeated: each rank's gradient reaches the gate rows, "
    "up rows and down columns of F/P hidden units, the same units in all three, no row or column on two ranks "
    "(the FAIL line counts rows and columns, it does not say where a unit's rows lie), and the ranks' gradients "
    "sum to one device's; each rank reads at most 2F/P rows from the files (the whole gate_up never on one rank); "
    "the region's operators called once each way (one all-reduce, or one all-gather and one reduce-scatter, in "
    "each direction) and nothing else; no call into the library",
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
    "layer_bytes": "the predicted bytes one rank contributes to collectives in one training step of one lab-model "
    "layer in Megatron-SP form on the uneven contiguous layout (the conjugates' all-gathers and reduce-scatters of "
    "padded blocks, the RMSNorm gains' gradient sync, the K/V heads' sync over their own ranks) and the bytes it "
    "sends with ring algorithms, each exact against the grader's theory; shown beside them (not scored), what the "
    "student's own parts 1-3 sent, run live as that layer",
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


def calls_line(what: str, ranks_calls: list[list[list]], expected: list[list]) -> str:
    """One verdict line: every rank made exactly the calls `expected` (in order; None matches anything); else the
    first rank that did not, what it made and what was expected."""
    for r, calls in enumerate(ranks_calls):
        if len(calls) != len(expected) or not all(map(_matches, calls, expected)):
            return f"{what}: rank {r} made {_shown(calls)}, expected {_shown(expected)}: FAIL"
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


def _through(op, inp: torch.Tensor, loss_of) -> dict:
    """Rank code: out = op(inp) and loss_of(out).backward(), each direction recorded and guarded. A hook on out
    keeps the gradient autograd hands to op's backward, with a copy taken when it arrived: op must not change it."""
    incoming = []  # (dL/d(op's output) as autograd passes it on, a copy taken when it arrived)
    with recording() as forward, library_calls(LIBRARY) as called:
        out = op(inp)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(lambda grad: incoming.append((grad, grad.detach().clone())))
    with recording() as backward, library_calls(LIBRARY) as called_backward:
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


def _sp_calls_line(what: str, cases: dict[str, list[list]], kind: str, limit: int) -> str:
    """Every rank of every case made one call of `kind` over all ranks, contributing at most `limit` bytes."""
    everyone = list(range(P))
    for case, ranks_calls in cases.items():
        for r, calls in enumerate(ranks_calls):
            if len(calls) != 1 or calls[0][0] != kind or calls[0][2] != everyone or calls[0][1] > limit:
                return (
                    f"{what}: {case}, rank {r} made {_shown(calls)}, expected one {kind} over ranks {everyone} "
                    f"contributing at most {limit} bytes: FAIL"
                )
    return f"{what}: PASS"


def judge_conjugates(data) -> list[str]:
    ranks, ref = data["ranks"], conjugates_problem()  # host: the reference on one device
    summed_gs, summed_u = ref["gs"].sum(0), ref["u"].sum(0)  # [B, SEQ, H]: over the ranks
    gathers = {name: [res[f"gather {name}"] for res in ranks] for name in LAYOUTS}
    scatters = {name: [res[f"scatter {name}"] for res in ranks] for name in LAYOUTS}

    def tokens_of(t: torch.Tensor, layout, r: int) -> torch.Tensor:
        return t[:, layout[r]]

    def block(layout) -> int:  # bytes of one rank's tokens padded to the largest rank's count: [B, max n_r, H]
        return BATCH * max(map(len, layout)) * H * 8

    limits = {name: block(layout) for name, layout in LAYOUTS.items()}
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
            "gather_tokens forward: one all-gather, each rank contributing at most B max(n_r) H numbers",
            {name: [res["forward"] for res in gathers[name]] for name in LAYOUTS},
            "all-gather",
            max(limits.values()),
        ),
        _sp_calls_line(
            "gather_tokens backward: one reduce-scatter, each rank contributing at most P B max(n_r) H numbers",
            {name: [res["backward"] for res in gathers[name]] for name in LAYOUTS},
            "reduce-scatter",
            P * max(limits.values()),
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
            "scatter_tokens forward: one reduce-scatter, each rank contributing at most P B max(n_r) H numbers",
            {name: [res["forward"] for res in scatters[name]] for name in LAYOUTS},
            "reduce-scatter",
            P * max(limits.values()),
        ),
        _sp_calls_line(
            "scatter_tokens backward: one all-gather, each rank contributing at most B max(n_r) H numbers",
            {name: [res["backward"] for res in scatters[name]] for name in LAYOUTS},
            "all-gather",
            max(limits.values()),
        ),
        _incoming_line("scatter_tokens backward", scatters),
        _library_line(
            "the conjugates", [{"library": [c for part in res.values() for c in part["library"]]} for res in ranks]
        ),
    ]
    return lines


# ------------------------------------------------------------------------------- the lab model's SwiGLU MLP


class FusedCheckpoint:
    """A fused gate/up checkpoint as a run of `saved` tensor-parallel ranks left it: file s [2F/saved, H] holds the
    gate and up rows of that rank's units [s F/saved, (s+1) F/saved), arranged by `fused`:

    - "[gate; up]": the units' gate rows, then the same units' up rows;
    - "interleaved": unit by unit, each unit's gate row followed by its up row.

    A rank reads rows only through read(), which counts them: the whole gate_up [2F, H] is never to be built on one
    rank. The files are leaves that require grad: the rows that receive a gradient on a rank are the ones it used."""

    def __init__(self, files: list[torch.Tensor], fused: str):
        self._files = files
        self.meta = {"saved_ranks": len(files), "fused": fused, "file_shape": list(files[0].shape)}
        self.rows_read = 0

    @classmethod
    def write(cls, gate: torch.Tensor, up: torch.Tensor, saved: int, fused: str) -> FusedCheckpoint:
        """The files a run of `saved` ranks writes from gate and up [F, H], as leaves."""
        k = gate.shape[0] // saved
        files = []
        for s in range(saved):
            g_s, u_s = gate[s * k : (s + 1) * k], up[s * k : (s + 1) * k]  # [k, H] each: rank s's units
            pair = torch.cat([g_s, u_s]) if fused == "[gate; up]" else torch.stack([g_s, u_s], dim=1).flatten(0, 1)
            files.append(pair.detach().clone().requires_grad_())
        return cls(files, fused)

    def read(self, file: int, rows) -> torch.Tensor:
        """Rows of file `file` (an index, a list, a range, a slice or an index tensor) -> [n, H]."""
        if isinstance(rows, range):
            rows = list(rows)
        block = self._files[file][rows]
        self.rows_read += 1 if block.dim() == 1 else block.shape[0]
        return block

    def grads(self) -> torch.Tensor | None:
        """The files' gradients in file order, [2F, H] (None if no gradient reached a file): grader's bookkeeping."""
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self._files]
        return None if all(t.grad is None for t in self._files) else torch.cat(grads).detach()


def row_units(F_: int, saved: int, fused: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of the files in file order: the unit it belongs to and whether it is an up row ([2F] each)."""
    k = F_ // saved
    rows = torch.arange(2 * F_)  # host: the grader's bookkeeping
    file, within = rows // (2 * k), rows % (2 * k)
    if fused == "[gate; up]":
        return file * k + within % k, within >= k
    return file * k + within // 2, within % 2 == 1


def swiglu_problem(seed: int = 2) -> dict[str, torch.Tensor]:
    """The lab model's first MLP (parlab.core.lab_model.SwiGLU, H -> F -> H, no biases): gate and up [F, H], down
    [H, F]. x: [B, SEQ, H] and G = dL/dy: [B, SEQ, H]."""
    mlp = build_lab_model(MLP_CFG, seed).blocks[0].mlp  # host: the problem's data; rank code moves it (_on_device)
    gen = torch.Generator().manual_seed(seed + 10)
    return {
        "gate": mlp.gate.weight.detach().clone(),  # [F, H]
        "up": mlp.up.weight.detach().clone(),  # [F, H]
        "down": mlp.down.weight.detach().clone(),  # [H, F]
        "x": _randn(gen, BATCH, SEQ, MLP_CFG.hidden),
        "g": _randn(gen, BATCH, SEQ, MLP_CFG.hidden),
    }


def _regions(layout_name, f, g, gather_tokens, scatter_tokens):
    """The region's two operators: f and g, or the sequence-parallel pair on the named layout."""
    if layout_name is None:
        return f, g
    layout = LAYOUTS[layout_name]
    return (lambda x: gather_tokens(x, layout)), (lambda y: scatter_tokens(y, layout))


def run_swiglu(swiglu, f, g, gather_tokens, scatter_tokens) -> dict:
    """Rank code, for each case: every rank is handed the checkpoint's files (read through FusedCheckpoint.read) and
    down (a leaf: the columns that receive a gradient are the ones this rank used), and x (whole, or this rank's
    tokens in a sequence-parallel region); it returns y the same way."""
    r, out = dist.get_rank(), {}
    for name, (saved, fused, layout_name) in SWIGLU_CASES.items():
        data = _on_device(swiglu_problem())
        mine = slice(None) if layout_name is None else _tokens(LAYOUTS[layout_name], r)
        x = data["x"][:, mine].clone().requires_grad_()
        ckpt = FusedCheckpoint.write(data["gate"], data["up"], saved, fused)
        down = data["down"].clone().requires_grad_()
        enter, leave = _regions(layout_name, f, g, gather_tokens, scatter_tokens)
        with recording() as forward_calls, library_calls(LIBRARY) as called:
            y = swiglu(x, ckpt, down, enter, leave)
        with recording() as backward_calls, library_calls(LIBRARY) as called_backward:
            (y * data["g"][:, mine]).sum().backward()
        out[name] = {
            "y": y.detach(),
            "grad_x": x.grad,
            "grad_files": ckpt.grads(),
            "grad_down": down.grad,
            "rows_read": ckpt.rows_read,
            "forward": forward_calls,
            "backward": backward_calls,
            "library": [*called, *called_backward],
        }
    return out


def collect_swiglu(swiglu, f, g, gather_tokens, scatter_tokens) -> dict:
    return {"ranks": list(parlab.launch(run_swiglu, P, swiglu, f, g, gather_tokens, scatter_tokens, **LAUNCH))}


def _units_line(name: str, saved: int, fused: str, ranks: list[dict]) -> str:
    """Each rank's gradient touches the gate rows, up rows and down columns of the same F/P units, disjoint. The
    FAIL lines speak of rows read and units, never of where in the files a unit's rows lie (that is the part)."""
    what = f"{name}: the work split, not repeated: no row of the files or column of down used by two ranks"
    F_ = MLP_CFG.ffn
    unit, is_up = row_units(F_, saved, fused)
    owner = torch.full((F_,), -1)  # host: the grader's bookkeeping of which rank used each unit
    for r, res in enumerate(ranks):
        if res["grad_files"] is None or res["grad_down"] is None:
            return f"{what}: rank {r}: no gradient reached the checkpoint's files or down: FAIL"
        rows = res["grad_files"].abs().sum(dim=1) != 0  # [2F]: the file rows this rank's result depends on
        gate, up = unit[rows & ~is_up].sort().values, unit[rows & is_up].sort().values
        down = (res["grad_down"].abs().sum(dim=0) != 0).nonzero().flatten()
        if not (torch.equal(gate, up) and torch.equal(gate, down)):
            return (
                f"{what}: rank {r}'s gradient reached {int(rows.sum())} rows of the files and {len(down)} columns of "
                "down, expected the gate row, the up row and the down column of each hidden unit it reached: FAIL"
            )
        if len(gate) != F_ // P:
            return f"{what}: rank {r} used {len(gate)} of the F hidden units, expected F/P = {F_ // P}: FAIL"
        taken = gate[owner[gate] >= 0]
        if len(taken):
            return f"{what}: rank {r} used {len(taken)} hidden units that rank {int(owner[taken[0]])} used too: FAIL"
        owner[gate] = r
    return f"{what}: PASS"


def _reads_line(name: str, ranks: list[dict]) -> str:
    """Each rank read at most its own units' 2F/P rows from the files: the whole gate_up never on one rank."""
    limit = 2 * MLP_CFG.ffn // P
    what = f"{name}: each rank reads at most {limit} rows of the files (2F/P)"
    for r, res in enumerate(ranks):
        if res["rows_read"] > limit:
            return f"{what}: rank {r} read {res['rows_read']} rows, expected at most {limit}: FAIL"
    return f"{what}: PASS"


def _region_calls(layout_name, nbytes: int) -> tuple[list[list], list[list]]:
    """The calls a region's operators make (forward, backward): f and g's all-reduces of [B, T, H] over every
    rank, or the sequence-parallel pair's all-gather and reduce-scatter (their sizes are part 1's business)."""
    everyone = list(range(P))
    if layout_name is None:
        return [["all-reduce", nbytes, everyone]], [["all-reduce", nbytes, everyone]]
    gather, scatter = ["all-gather", None, everyone], ["reduce-scatter", None, everyone]
    return [gather, scatter], [gather, scatter]  # backward: the scatter's all-gather first, then the gather's


def _region_words(layout_name, nbytes: int) -> str:
    if layout_name is None:
        return f"one all-reduce of [B, T, H] ({nbytes} bytes)"
    return "the region's all-gather, then its reduce-scatter"


def judge_swiglu(data) -> list[str]:
    lines = []
    ref = swiglu_problem()  # host: the reference on one device
    for name, (saved, fused, layout_name) in SWIGLU_CASES.items():
        ranks = [res[name] for res in data["ranks"]]
        x = ref["x"].clone().requires_grad_()
        ckpt = FusedCheckpoint.write(ref["gate"], ref["up"], saved, fused)
        files = torch.cat(ckpt._files)  # [2F, H]: the grader, on one device, may hold it whole
        down = ref["down"].clone().requires_grad_()
        unit, is_up = row_units(MLP_CFG.ffn, saved, fused)  # the files' rows back in unit order: [F, H] each
        w_gate = files[(~is_up).nonzero().flatten()[unit[~is_up].argsort()]]
        w_up = files[is_up.nonzero().flatten()[unit[is_up].argsort()]]
        y = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), down)  # the lab model's SwiGLU
        (y * ref["g"]).sum().backward()
        layout = None if layout_name is None else LAYOUTS[layout_name]
        mine = [slice(None) if layout is None else layout[r] for r in range(P)]
        grads = {"files": [res["grad_files"] for res in ranks], "down": [res["grad_down"] for res in ranks]}
        summed = {key: sum(g) if None not in g else None for key, g in grads.items()}
        activation = BATCH * SEQ * MLP_CFG.hidden * 8
        forward, backward = _region_calls(layout_name, activation)
        where = "on every rank" if layout is None else "each rank's tokens"
        lines += [
            ranks_line(f"{name}: y, {where}", [res["y"] for res in ranks], [y.detach()[:, m] for m in mine]),
            ranks_line(f"{name}: dL/dx, {where}", [res["grad_x"] for res in ranks], [x.grad[:, m] for m in mine]),
            _units_line(name, saved, fused, ranks),
            compare(
                f"{name}: dL/d(files), dL/d(down): the ranks' gradients summed",
                summed,
                {"files": ckpt.grads(), "down": down.grad},
            ).line,
            _reads_line(name, ranks),
            calls_line(
                f"{name}: forward, every rank: {_region_words(layout_name, activation)}, nothing else",
                [res["forward"] for res in ranks],
                forward,
            ),
            calls_line(
                f"{name}: backward, every rank: {_region_words(layout_name, activation)}, nothing else",
                [res["backward"] for res in ranks],
                backward,
            ),
        ]
    every = [{"library": [c for res in data["ranks"] for case in res.values() for c in case["library"]]}]
    lines.append(_library_line("the SwiGLU MLP", every))
    return lines


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
            "library": [*called_init, *called, *called_backward, *synced],
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
            if held.shape != expected.shape or not torch.equal(held.cpu(), expected):
                return f"{what}: rank {r}'s {w}.weight is {list(held.shape)}, expected {list(expected.shape)}: FAIL"
        for w in ("k", "v"):
            held = res["weights"][w]
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
        forward, backward = _region_calls(layout_name, activation)
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
                f"{name}: forward, every rank: {words}, nothing else", [res["forward"] for res in ranks], forward
            ),
            calls_line(
                f"{name}: backward, every rank: {words}, nothing else", [res["backward"] for res in ranks], backward
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


# ---------------------------------------------------------------------------------------- prediction: a layer


def layer_theory(
    cfg: LabConfig = LAYER_CFG, batch: int = LAYER_BATCH, layout: list[list[int]] = LAYER_LAYOUT
) -> dict[str, float]:
    """One lab-model layer in Megatron-SP form on len(layout) ranks, one training step, per rank, float64.

    The layer: rank r holds its tokens' [B, n_r, H]; RMSNorm and the residual adds on them; attention and the MLP
    each in a region entered by gather_tokens and left by scatter_tokens. Forward: an all-gather in front of each
    region, a reduce-scatter behind it; backward: the conjugates, a reduce-scatter and an all-gather each. With
    uneven n_r every block is padded to the largest: an all-gather takes one block [B, max n_r, H] from each rank,
    a reduce-scatter P blocks from each. The RMSNorm gains are replicated but see only this rank's tokens: their
    gradients (2 H numbers) are partial sums, all-reduced over all ranks. Each K/V head lives on m = P / nkv ranks:
    its k and v gradients (2 hd H numbers) are all-reduced over those m. Ring algorithms (lesson 00): an
    all-gather sends P-1 blocks, a reduce-scatter P-1 blocks, an all-reduce over n ranks 2 (n-1)/n of its tensor."""
    ranks, e = len(layout), cfg.dtype_bytes
    block = batch * max(map(len, layout)) * cfg.hidden * e  # one rank's padded tokens
    gains = 2 * cfg.hidden * e
    m = max(ranks // cfg.kv_heads, 1)  # ranks that share one K/V head
    kv_sync = 2 * cfg.head_size * cfg.hidden * e if m > 1 else 0
    return {
        "payload_bytes": 4 * block + 4 * ranks * block + gains + kv_sync,
        "wire_bytes": 8 * (ranks - 1) * block + 2 * (ranks - 1) / ranks * gains + 2 * (m - 1) / m * kv_sync,
    }


THEORY = {"layer_bytes": layer_theory}


def plain(value) -> float | str:
    """A prediction as plain data for the grader: a float, or (what cannot be one) a short text."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def run_layer(gather_tokens, scatter_tokens, swiglu, module_class) -> list[list]:
    """Rank code: one training step of one LAYER_CFG layer in Megatron-SP form built from the student's parts
    (their region operators on LAYER_LAYOUT, their attention and MLP), the RMSNorm gains' partial gradients summed
    by this check: every call recorded."""
    r, cfg, layout = dist.get_rank(), LAYER_CFG, LAYER_LAYOUT
    block = build_lab_model(cfg, seed=5, device=parlab.device()).blocks[0]
    gen = torch.Generator().manual_seed(6)
    x_all, g_all = (_randn(gen, LAYER_BATCH, cfg.seq_len, cfg.hidden).to(parlab.device()) for _ in range(2))
    mine = _tokens(layout, r)
    x = x_all[:, mine].clone().requires_grad_()  # [B, n_r, H]: this rank's tokens
    gains = [norm.weight.detach().clone().requires_grad_() for norm in (block.attn_norm, block.mlp_norm)]  # [H] each
    ckpt = FusedCheckpoint.write(block.mlp.gate.weight, block.mlp.up.weight, 1, "[gate; up]")  # one writer
    down = block.mlp.down.weight.detach().clone().requires_grad_()
    enter, leave = (lambda t: gather_tokens(t, layout)), (lambda t: scatter_tokens(t, layout))
    positions = torch.arange(cfg.seq_len, device=parlab.device())  # one document, rows in order
    documents = torch.zeros(cfg.seq_len, dtype=torch.long, device=parlab.device())
    with library_calls(LIBRARY):
        attn = module_class(block.attn, enter, leave)
    with recording() as calls, library_calls(LIBRARY):
        h = x + attn(rms_norm(x, gains[0], cfg.eps), positions, documents)
        y = h + swiglu(rms_norm(h, gains[1], cfg.eps), ckpt, down, enter, leave)
        (y * g_all[:, mine]).sum().backward()
        attn.sync_grads()
        partial = torch.cat([gain.grad for gain in gains])  # [2H]: this rank's tokens' share
        comm.all_reduce(partial)  # the gains' gradients over every rank's tokens
    return calls


def collect_layer_bytes(predicted: dict, gather_tokens=None, scatter_tokens=None, swiglu=None, module_class=None):
    out = {"predicted": {k: plain(predicted.get(k)) for k in ("payload_bytes", "wire_bytes")}}
    try:
        ranks = parlab.launch(run_layer, P, gather_tokens, scatter_tokens, swiglu, module_class, **LAUNCH)
        out["measured"] = list(ranks)
    except Exception as exc:  # the parts are not done yet: the prediction is scored all the same
        out["measured_error"] = error_summary(exc)[:200]
    return out


def _ring_bytes(call: list) -> float:
    """What one rank sends for a recorded collective with the ring algorithms (lesson 00)."""
    kind, contributed, group = call
    n = max(len(group), 1)
    if kind == "all-gather":
        return (n - 1) * contributed
    if kind == "reduce-scatter":
        return (n - 1) / n * contributed
    if kind == "all-reduce":
        return 2 * (n - 1) / n * contributed
    return float(contributed)


def judge_layer_bytes(data) -> list[str]:
    theory, predicted = layer_theory(), data["predicted"]
    labels = {
        "payload_bytes": "bytes one rank contributes to collectives, one layer, one step",
        "wire_bytes": "bytes one rank sends with ring algorithms, one layer, one step",
    }
    measured = {}
    if "measured" in data:
        busiest = max(data["measured"], key=lambda calls: sum(c[1] for c in calls))
        measured = {"payload_bytes": sum(c[1] for c in busiest), "wire_bytes": sum(map(_ring_bytes, busiest))}
    lines = []
    for key, label in labels.items():
        verdicts = prediction_lines(label, predicted[key], theory[key], rtol=0)
        lines += verdicts
        if not verdicts[-1].endswith(": PASS"):
            lines.append(f"{label}: your parts' live run is shown once the prediction is right")
        elif measured:
            lines.append(
                f"{label}: measured in a live run of your parts 1-3 as that layer (busiest rank): {measured[key]:,.0f}"
            )
        else:
            lines.append(
                f"{label}: not measured: your parts 1-3 did not run as that layer ({data.get('measured_error', '')})"
            )
    return lines
