"""Every scheme's twin, by name; the rank side that runs it after parlab's rank code; the parent side that compares."""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parlab.runtime.errors import Results
from parlab.twins.twin import Twin, no_twin


@functools.cache
def registry() -> dict[str, Twin]:
    """Every scheme's twin, by scheme name (the modules are imported on first use)."""
    from parlab.twins import data, pipeline, sequence, tensor

    found: dict[str, Twin] = {}
    for module in (data, tensor, sequence, pipeline):
        found.update(module.TWINS)
    found["ps"] = no_twin(
        "no PyTorch twin",
        "the parameter server has no PyTorch twin: torch.distributed ships no parameter server (its RPC framework "
        "is the toolkit one would build it with, and is not on the gloo process group this run uses)",
    )
    found["moe"] = no_twin(
        "no PyTorch twin",
        "mixture of experts has no core PyTorch twin: expert routing and its all-to-all live in libraries "
        "(torchtitan, DeepSpeed-MoE, Megatron-Core), not in torch.distributed",
    )
    return found


FAILURE_RUN = (
    "a run with an injected failure (--kill-rank) checks the restart from a sharded checkpoint; its PyTorch "
    "counterpart (torch.distributed.checkpoint: dcp.save, then dcp.load resharded onto the survivors) is not "
    "twinned here"
)


# What torch says when it is handed tensors on the wrong device: parlab's fault (its own CPU tensors under NCCL, a
# batch on one device and the model on another), never a reason to skip a twin. The first GPU run reported two such
# errors as "torch refused on this machine".
DEVICE_ERRORS = (
    "No backend type associated with device type",  # a CPU tensor handed to an NCCL group
    "Expected all tensors to be on the same device",
    "different from other tensors on",  # "target is on cpu, different from other tensors on cuda:0"
)


def device_error(exc: BaseException) -> bool:
    """Whether an error raised in a twin is a tensor on the wrong device (parlab's bug), rather than torch
    refusing an operation on this machine."""
    from parlab.core.comm import DeviceMismatch

    return isinstance(exc, DeviceMismatch) or any(words in str(exc) for words in DEVICE_ERRORS)


def skip_reason(twin: Twin, opts) -> str:
    """Why `twin` does not run with these options ("" when it does)."""
    if getattr(opts, "kill_rank", None) is not None:
        return FAILURE_RUN
    return twin.skip(opts) if twin.skip else ""


# --------------------------------------------------------------------------------------------- rank side


@dataclass
class Twinned:
    """What a rank returns when a twin ran after parlab's rank code: parlab's value, and the twin's output."""

    value: Any
    twin: dict | None


def with_twin(scheme: str, rank_fn: Callable[[Any], Any]) -> Callable[[Any], Twinned]:
    """The scheme's rank code, followed on the same ranks and process group by its twin."""
    return functools.partial(_twinned_rank, scheme, rank_fn)


def _twinned_rank(scheme: str, rank_fn: Callable[[Any], Any], opts) -> Twinned:
    value = rank_fn(opts)
    return Twinned(value, run_twin(scheme, opts, value))


def run_twin(scheme: str, opts, value) -> dict | None:
    """Rank code: the twin of `scheme` on this rank, its traffic recorded; None when nothing is to run.

    A torch error (e.g. an operator torch has no distributed rule for on CPU) comes back as {"error": text}: the
    report says the twin was skipped and quotes it. Errors torch raises do so on every rank at the same point
    (before any collective), so the ranks stay in step. A tensor on the wrong device is no such refusal: it comes
    back with "device_error" set, and the twin fails."""
    from parlab.twins.record import recording

    twin = registry().get(scheme)
    if twin is None or twin.rank is None or skip_reason(twin, opts):
        return None
    start = time.perf_counter()
    try:
        with recording() as events:
            out = twin.rank(opts, value)
    except (NotImplementedError, RuntimeError) as exc:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        return {"error": text, "where": last.name, "device_error": device_error(exc)}
    out["events"] = events if not out.get("reused") else []
    out["seconds"] = time.perf_counter() - start
    return out


# ------------------------------------------------------------------------------------------- parent side


def split(results: Results) -> tuple[Results, list[dict | None]]:
    """Parlab's results (as the scheme's report expects them) and the twin's outputs, in rank order."""
    values = [r.value if isinstance(r, Twinned) else r for r in results]
    twins = [r.twin if isinstance(r, Twinned) else None for r in results]
    return results.derived(values), twins


def twin_report(scheme: str, opts, results: Results, outs: list[dict | None]) -> dict:
    """The report's `twin` object: {name, max_abs_err, tol, passed, verdicts, comm, seconds} or {name, skipped}."""
    from parlab.twins.record import bytes_per_rank

    twin = registry().get(scheme)
    if twin is None:
        return {"name": "no PyTorch twin", "skipped": f"no twin is registered for scheme {scheme!r} yet"}
    name = twin.title(opts)
    reason = skip_reason(twin, opts)
    if reason:
        return {"name": name, "skipped": reason}
    wrong_device = [o["error"] for o in outs if o and o.get("device_error")]
    if wrong_device:  # parlab's bug, not torch's refusal: the twin fails
        return {"name": name, "passed": False, "error": f"a tensor on the wrong device: {wrong_device[0]}"}
    errors = [o["error"] for o in outs if o and "error" in o]
    if errors:
        return {"name": name, "skipped": f"torch refused on this machine: {errors[0]}"}
    verdicts = twin.compare(opts, results, outs)
    worst = max(verdicts, key=lambda v: v.max_abs_err)
    ran = [o for o in outs if o]
    measured = ran and not any(o.get("reused") for o in ran)
    return {
        "name": name,
        "max_abs_err": worst.max_abs_err,
        "tol": worst.tol,
        "passed": all(v.passed for v in verdicts),
        "verdicts": [v.line for v in verdicts],
        # The twin's payload per kind and rank, counted like parlab's (None: it ran inside parlab's rank code).
        "comm": bytes_per_rank([o["events"] for o in outs]) if measured else None,
        "seconds": max((o["seconds"] for o in ran), default=0.0),
    }


def twin_line(report: dict) -> str:
    """One line for `python -m parlab tour`: the scheme's twin and its verdict."""
    twin = report.get("twin")
    if twin is None:
        return f"{report['scheme']}: twin not run"
    if "skipped" in twin:
        return f"{report['scheme']} vs {twin['name']}: SKIPPED: {twin['skipped']}"
    if "error" in twin:
        return f"{report['scheme']} vs {twin['name']}: FAIL: {twin['error']}"
    status = "PASS" if twin["passed"] else "FAIL"
    return (
        f"{report['scheme']} vs {twin['name']}: max |err| {twin['max_abs_err']:.1e} vs tol {twin['tol']:.0e}: {status}"
    )
