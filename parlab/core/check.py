"""Compare a parallel result with the single-device reference and say so in one deterministic line.

    verdict = compare("loss after 3 steps", parallel_losses, reference_losses)
    # loss after 3 steps: matches single device: max |err| 2.2e-16 <= tol 1e-10 (float64): PASS

Verdict lines are what `pytest --nbval` compares in the notebooks and what graders read, so they never contain
a time. The error is printed with two significant digits; the sanitize file that nbval uses masks its digits
(they may differ in the last bits between machines), while PASS/FAIL and the tolerance are compared as written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Per-dtype tolerances on max |parallel - reference|. float64 is where exactness is the lesson (a correct scheme
# agrees to ~1e-14); float32 reductions in another order differ by ~1e-6 (e.g. a row-parallel GEMM), hence 1e-5.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-3,
}


class CheckFailed(AssertionError):
    """A verdict was FAIL and the caller asked for an exception."""


@dataclass(frozen=True)
class Verdict:
    what: str
    max_abs_err: float
    tol: float
    dtype: str
    note: str = ""
    against: str = "single device"  # what the reference is: "single device", "torch DDP", ...

    @property
    def passed(self) -> bool:
        return self.max_abs_err <= self.tol  # NaN compares False, so NaN fails

    @property
    def line(self) -> str:
        if self.passed:
            relation, sign, status = f"matches {self.against}", "<=", "PASS"
        else:
            relation, sign, status = f"DIFFERS from {self.against}", ">", "FAIL"
        text = f"{self.what}: {relation}: max |err| {self.max_abs_err:.1e} {sign} tol {self.tol:.0e} ({self.dtype})"
        if self.note:
            text += f" [{self.note}]"
        return f"{text}: {status}"

    def __str__(self) -> str:
        return self.line


def _leaves(value: Any) -> list:
    """The tensors (and numbers) inside nested lists, tuples and dicts, in a fixed order."""
    if isinstance(value, dict):
        return [leaf for key in sorted(value, key=str) for leaf in _leaves(value[key])]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def host_values(numbers: Any, dtype: torch.dtype) -> torch.Tensor:
    """Plain numbers (a run's losses, say) as a tensor of the run's dtype, on the host where verdicts are made:
    compare() takes its tolerance from the dtype, so a float32 run is held to float32's."""
    return torch.tensor(list(numbers), dtype=dtype)  # host: verdicts are made on the host


def _as_tensor(x: Any) -> torch.Tensor:
    # host: verdicts compare on the host, whatever device the ranks computed on
    return x.detach().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(x)  # host: see above


def max_abs_error(parallel: Any, reference: Any) -> tuple[float, str]:
    """max |parallel - reference| over matching tensors; (inf, reason) if the structures or shapes differ."""
    if isinstance(parallel, dict) and isinstance(reference, dict) and set(parallel) != set(reference):
        missing = sorted(set(reference) - set(parallel), key=str)
        extra = sorted(set(parallel) - set(reference), key=str)
        return math.inf, f"keys differ: missing {missing[:3]}, unexpected {extra[:3]}"
    ours, theirs = _leaves(parallel), _leaves(reference)
    if len(ours) != len(theirs):
        return math.inf, f"{len(ours)} values vs {len(theirs)} in the reference"
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        if a is None:
            return math.inf, "a value is None"
        a, b = _as_tensor(a), _as_tensor(b)
        if a.shape != b.shape:
            return math.inf, f"shape {list(a.shape)} vs {list(b.shape)} in the reference"
        if a.numel():
            diff = (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()
            worst = max(worst, diff) if not math.isnan(diff) else math.nan
        if math.isnan(worst):
            return math.nan, "NaN in the result"
    return worst, ""


def _dtype_of(values: Any) -> torch.dtype:
    for leaf in _leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return torch.float64


def compare(
    what: str,
    parallel: Any,
    reference: Any,
    tol: float | None = None,
    *,
    show: bool = False,
    raise_on_fail: bool = False,
    against: str = "single device",
) -> Verdict:
    """Compare `parallel` with the single-device `reference` (tensors, numbers, or lists/dicts of them).

    tol: the largest acceptable max |err|; by default TOLERANCE for the reference's dtype.
    against: what the reference is, for the verdict line (another implementation, e.g. "torch DDP").
    show: also print the verdict line (a notebook cell's; code that collects verdicts leaves it off).
    raise_on_fail: raise CheckFailed if the verdict is FAIL.
    """
    dtype = _dtype_of(reference)
    tol = TOLERANCE.get(dtype, 1e-5) if tol is None else tol
    err, note = max_abs_error(parallel, reference)
    verdict = Verdict(what, err, tol, str(dtype).removeprefix("torch."), note, against)
    if show:
        print(verdict.line)
    if raise_on_fail and not verdict.passed:
        raise CheckFailed(verdict.line)
    return verdict


@dataclass(frozen=True)
class CountCheck:
    """An exact check of a counted figure (bytes, messages) against its theory: equal, or FAIL.

    relation "==" (the default): measured must equal the theory; ">=": measured must reach it (a bound, e.g. the
    staleness an asynchronous server must at least see)."""

    what: str
    measured: int | float
    theory: int | float
    relation: str = "=="

    @property
    def passed(self) -> bool:
        return self.measured >= self.theory if self.relation == ">=" else self.measured == self.theory

    @property
    def line(self) -> str:
        if self.relation == ">=":
            sign = ">=" if self.passed else "<"
            return (
                f"{self.what}: measured {self.measured:g} {sign} {self.theory:g}: {'PASS' if self.passed else 'FAIL'}"
            )
        if self.passed:
            return f"{self.what}: measured {self.measured:g} = theory {self.theory:g}: PASS"
        return f"{self.what}: measured {self.measured:g} != theory {self.theory:g}: FAIL"

    def __str__(self) -> str:
        return self.line


def check_equal(what: str, measured: int | float, theory: int | float, *, show: bool = False) -> CountCheck:
    """A counted figure (bytes, message counts) measured in the ranks must equal the theory exactly."""
    check = CountCheck(what, measured, theory)
    if show:
        print(check.line)
    return check
