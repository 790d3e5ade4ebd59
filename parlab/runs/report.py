"""The skeleton every run's report shares (`python -m parlab run SCHEME --json`, and the notebooks' run_... helpers).

    run_report("tp", P, checks, comm={...}, layers=..., ...)

checks: every verdict of the run in order: `Verdict`s (numbers compared with the single-device run, each with its
max |err| and tolerance) and `CountCheck`s (bytes, calls, memory against theory). The run passes when all of them
pass (and `passed`, for a condition that is no verdict line). The report's max_abs_err and tol are the worst
comparison's. lines: the verdict lines, when a run prints more than its checks (default: one per check).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from parlab.core.check import Verdict


def run_report(
    scheme: str,
    world_size: int,
    checks: Sequence[Any],
    comm: dict,
    *,
    passed: bool = True,
    lines: list[str] | None = None,
    **extra: Any,
) -> dict:
    """{"scheme", "world_size", "passed", "max_abs_err", "tol", "comm", "verdicts", **extra} (parlab.runs'
    REQUIRED_KEYS), the scheme's own keys after them."""
    numeric = [c for c in checks if isinstance(c, Verdict)]
    if not numeric:
        raise ValueError(f"{scheme}: a report needs at least one comparison with the single-device run")
    worst = max(numeric, key=lambda v: v.max_abs_err)
    return {
        "scheme": scheme,
        "world_size": world_size,
        "passed": passed and all(c.passed for c in checks),
        "max_abs_err": worst.max_abs_err,
        "tol": worst.tol,
        "comm": comm,
        "verdicts": [c.line for c in checks] if lines is None else lines,
        **extra,
    }
