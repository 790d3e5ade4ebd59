"""What the ranks of lab 05 hand to gloo (a recorder of their process-group calls), and the helpers of the
verdict lines built from it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from parlab.core import probe
from parlab.core.check import compare
from parlab.core.probe import _tensors  # every tensor in a call's arguments
from parlab.grading.labs.lab05_setup import N

# ------------------------------------------------------------------------------- what the ranks hand to gloo

_GATHERS = {"all_gather_single", "_allgather_base", "allgather", "allgather_into_tensor_coalesced"}
_SCATTERS = {"reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced"}
_NAMES = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "alltoall": "all_to_all"}
_SKIP = {"rank", "size", "name", "group_name", "group_desc", "bound_device_id", "boxed", "unbox", "abort"}
_SKIP |= {"shutdown", "set_timeout", "get_group_store", "split_group", "merge_remote_group"}
_SKIP |= {"use_pg_for_symm_mem_rendezvous"}
_ROOTED = ("reduce", "broadcast")  # recorded as [op, payload bytes, root]; every other call as [op, payload bytes]


def _mirror(value):
    """Fresh tensors shaped as `value` (a tensor or nested lists of tensors)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    return [_mirror(item) for item in value]


def _copy_into(target, source) -> None:
    if isinstance(target, torch.Tensor):
        target.copy_(source)
    else:
        for t, s in zip(target, source, strict=True):
            _copy_into(t, s)


def _op(name: str) -> str:
    if name in _GATHERS or name.startswith("all_gather"):
        return "all_gather"
    if name in _SCATTERS or name.startswith("reduce_scatter"):
        return "reduce_scatter"
    return _NAMES.get(name, name)


def _refuse_bad_buffers(op: str, output: torch.Tensor, given: torch.Tensor, P: int) -> None:
    """A clear error, on the rank, for the buffers gloo would abort on from C++."""
    what = "all-gather" if op == "all_gather" else "reduce-scatter"
    if output.dtype != given.dtype:
        raise TypeError(
            f"{what}: the output buffer is {str(output.dtype).removeprefix('torch.')} but the input is "
            f"{str(given.dtype).removeprefix('torch.')}: a buffer must have the dtype of the numbers it receives"
        )
    small, large = (given, output) if op == "all_gather" else (output, given)
    if large.numel() != P * small.numel():
        if op == "all_gather":
            sizes = f"the output holds {output.numel():,} numbers, not N = {P} times the input's {given.numel():,}"
        else:
            sizes = f"the input holds {given.numel():,} numbers, not N = {P} times the output's {output.numel():,}"
        raise ValueError(f"{what}: {sizes} (every rank's chunk must have the same size)")


class Recorder:
    """The calls a rank makes into its process group while recording, and the all-gathered buffers' storages."""

    def __init__(self):
        self.calls: list[list] = []  # [op, payload bytes] ([op, payload bytes, root] for reduce, broadcast), in order
        self.dtypes: set[str] = set()  # the dtypes of the payloads, e.g. {"float64"}
        self._gathered: list = []  # weak references to the storages all-gathers wrote into
        self.peak_gathered = 0  # the most bytes of all-gathered buffers alive at once (right after each gather)
        self.alive_at_gather: list[int] = []  # the bytes of all-gathered buffers alive as each all-gather returned

    def gathered_alive(self) -> int:
        """Bytes of the storages all-gathers wrote into that are still alive (a storage resized to 0 counts 0)."""
        seen, total = set(), 0
        for ref in self._gathered:
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is not None and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def _record(self, name: str, args) -> None:
        op = _op(name)
        given = _tensors(args[1]) if op in ("all_gather", "reduce_scatter") and len(args) > 1 else []
        payload = given if op in ("all_gather", "reduce_scatter") else (_tensors(args[0]) if args else [])
        call = [op, sum(t.numel() * t.element_size() for t in payload)]
        if op in _ROOTED:  # a reduce's destination, a broadcast's source: the group rank in its options
            call.append(getattr(args[1], "rootRank", None) if len(args) > 1 else None)
        self.calls.append(call)
        self.dtypes.update(str(t.dtype).removeprefix("torch.") for t in payload)

    def _after(self, name: str, self_pg, args) -> None:
        if _op(name) == "all_gather" and args:
            from torch.multiprocessing.reductions import StorageWeakRef

            self._gathered += [StorageWeakRef(t.untyped_storage()) for t in _tensors(args[0])]
            self.alive_at_gather.append(self.gathered_alive())
            self.peak_gathered = max(self.peak_gathered, self.alive_at_gather[-1])


@contextmanager
def recording() -> Iterator[Recorder]:
    """Record this process's process-group calls inside the block (whatever the student called: parlab.core.comm,
    torch.distributed or the group itself); refuse a mismatched all-gather or reduce-scatter with a sentence."""
    from torch._C._distributed_c10d import ProcessGroup

    recorder = Recorder()
    names = [m for m in dir(ProcessGroup) if not m.startswith("__") and m not in _SKIP]
    originals = {m: getattr(ProcessGroup, m) for m in names}
    originals = {m: fn for m, fn in originals.items() if callable(fn) and not isinstance(fn, type)}
    originals = {m: fn for m, fn in originals.items() if not m.startswith("_") or m in _GATHERS | _SCATTERS}

    def wrap(name, original):
        def recorded(self, *args, **kwargs):
            op = _op(name)
            if op in ("all_gather", "reduce_scatter") and len(args) > 1:
                out, given = args[0], args[1]
                if isinstance(out, torch.Tensor) and isinstance(given, torch.Tensor):
                    _refuse_bad_buffers(op, out, given, self.size())
            recorder._record(name, args)
            if op != "all_gather" or not args:
                return original(self, *args, **kwargs)
            # gloo's worker keeps the output it wrote for a while after the call: let it keep a copy, so that the
            # student's buffer lives exactly as long as the student's references to it.
            private = _mirror(args[0])
            work = original(self, private, *args[1:], **kwargs)
            work.wait()
            _copy_into(args[0], private)
            recorder._after(name, self, args)
            return work

        return recorded

    with probe.wrapped(ProcessGroup, originals, wrap):  # puts back the class's own methods afterwards
        yield recorder


@contextmanager
def one_thread() -> Iterator[None]:
    """The judges' single-device references run on one thread: tiny tensors, and with a busy CPU two threads
    spend most of their time waiting for each other (10x slower, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _line(what: str, measured, theory) -> str:
    """An exact verdict on counted figures (numbers or lists of them)."""
    if measured == theory:
        return f"{what}: measured {measured} = theory {theory}: PASS"
    return f"{what}: measured {measured} != theory {theory}: FAIL"


def same_line(got: list, expected, what: str = f"ranks 1-{N - 1}: the collectives of the theory") -> str:
    """Ranks 1.. made the collectives `expected` (got: theirs, from rank 1 on); else the first that did not, with
    what was expected and what came."""
    for r, calls in enumerate(got, start=1):
        if calls != expected:
            return f"{what}: rank {r}: expected {expected}, received {calls}: FAIL"
    return f"{what}: PASS"


def _verdict(passed: bool, passing: str, failing: str) -> str:
    """A verdict whose FAIL line names the symptom."""
    return f"{passing}: PASS" if passed else f"{failing}: FAIL"


def _dtype_line(ranks: list[dict]) -> str:
    """Every buffer handed to a collective in the model's dtype: float64."""
    wrong = sorted({d for res in ranks for d in res["dtypes"] if d != "float64"})
    where = [r for r, res in enumerate(ranks) if set(res["dtypes"]) & set(wrong)]
    return _verdict(
        not wrong,
        "every buffer handed to a collective is float64, the model's dtype",
        f"rank(s) {where} handed {' and '.join(wrong)} buffers to collectives, but the model is float64: the numbers "
        "lost precision on the way",
    )


def _scale(got, ref) -> float | None:
    """c when the tensors `got` equal c times `ref` to 0.1% (lists of tensors: all with the same c), else None (a
    diagnosis, not a verdict: Adam's m drifts a little from N times one device's once the parameters differ)."""
    got, ref = _tensors(got), _tensors(ref)
    if len(got) != len(ref) or any(g.shape != r.shape for g, r in zip(got, ref, strict=True)):
        return None
    got = torch.cat([g.reshape(-1) for g in got]).double()
    ref = torch.cat([r.reshape(-1) for r in ref]).double()
    size = float(ref.abs().max()) if ref.numel() else 0.0
    if size == 0:
        return None
    c = float(got @ ref / (ref @ ref))
    return c if float((got - c * ref).abs().max()) <= 1e-3 * max(abs(c), 1.0) * size else None


def _is(c: float | None, value: float) -> bool:
    return c is not None and abs(c - value) <= 1e-3 * abs(value)


def _fraction(c: float) -> str:
    from fractions import Fraction

    return str(Fraction(c).limit_denominator(1000))


def _compared(what: str, got, ref, per_rank_scale_hint: str) -> str:
    """compare()'s line; when it fails because every rank's tensors are N times one device's, a line saying so."""
    line = compare(what, got, ref).line
    if line.endswith(": PASS") or not all(_is(_scale(g, e), N) for g, e in zip(got, ref, strict=True)):
        return line
    return f"{what}: every rank's is N = {N} times one device's (to 0.1%): {per_rank_scale_hint}: FAIL"


SUMMED = "the reduce-scatter sums the ranks' gradients; the gradient of the whole batch is their mean"


def _by_op(calls: list) -> dict[str, list[int]]:
    """The payloads of the calls, grouped by collective (keys sorted), each group in order."""
    grouped: dict[str, list[int]] = {}
    for op, nbytes in calls:
        grouped.setdefault(op, []).append(nbytes)
    return dict(sorted(grouped.items()))


def _shard(flat: torch.Tensor, r: int, P: int) -> torch.Tensor:
    """Rank r's slice of `flat` zero-padded to P equal slices (the reference; a different road from yours)."""
    S = -(-flat.numel() // P)
    return torch.nn.functional.pad(flat.reshape(-1), (0, P * S - flat.numel())).view(P, S)[r].clone()


def tensors_line(what: str, got: list, expected: list, tol: float = 1e-10, who: list[str] | None = None) -> str:
    """One verdict on every rank's tensors against one device's (got, expected: per rank, a dict {name: tensor}).
    PASS: the largest error, as compare() prints it; FAIL: the first wrong item, with what was expected and what
    came (rank, tensor, element). who: how to name each entry of got (default "rank r")."""
    worst, first = 0.0, None
    for r, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        where = who[r] if who else f"rank {r}"
        for name, want in theirs.items():
            have = mine.get(name) if isinstance(mine, dict) else None
            if not isinstance(have, torch.Tensor) or have.shape != want.shape:
                shape = list(have.shape) if isinstance(have, torch.Tensor) else type(have).__name__
                first = first or f"{where}, {name}: expected shape {list(want.shape)}, received {shape}"
                worst = float("inf")
                continue
            diff = (have.double() - want.double()).abs()
            err = float(diff.max()) if diff.numel() else 0.0
            worst = max(worst, err)
            if first is None and not err <= tol:  # NaN fails too
                i = int(diff.reshape(-1).nan_to_num(float("inf")).argmax())
                at = f"[{i}]" if want.dim() == 1 else f" (element {i} of {list(want.shape)}, row-major)"
                first = (
                    f"{where}, {name}{at}: expected {float(want.reshape(-1)[i]):.6g}, received "
                    f"{float(have.reshape(-1)[i]):.6g}"
                )
    if first is None:
        return f"{what}: matches single device: max |err| {worst:.1e} <= tol {tol:.0e} (float64): PASS"
    return f"{what}: DIFFERS from single device, first wrong item: {first}: FAIL"
