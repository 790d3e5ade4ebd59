"""The skeleton every run's report shares (`python -m parlab run SCHEME --json`, and the notebooks' run_... helpers).

    run_report("tp", P, checks, comm={...}, layers=..., ...)

checks: every verdict of the run in order: `Verdict`s (numbers compared with the single-device run, each with its
max |err| and tolerance) and `CountCheck`s (bytes, calls, memory against theory). The run passes when all of them
pass (and `passed`, for a condition that is no verdict line). The report's max_abs_err and tol are the worst
comparison's. lines: the verdict lines, when a run prints more than its checks (default: one per check).

Most reports are built from the same three parts, and the helpers below write each part once:

    single = single_device_run(opts)                              # the reference: one device, the whole batch
    checks = one_device_checks(single, dtype, loss=(what, ours), grads=(what, ours), params=(what, ours))
    checks += count_checks([(what, measured, theory), ...])       # the counted figures, one row each
    return run_report(scheme, P, checks, comm={...}, **model_fields(cfg, opts, "layers", "hidden", ...))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from parlab.core.check import CountCheck, Verdict, check_equal, compare, host_values
from parlab.core.models import make_batches, train_single_device


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


# ---------------------------------------------------------------------------------- the parts a report is made of


def single_device_run(opts: Any, cfg: Any = None, optimizer: str | None = None) -> Any:
    """The reference every run is compared with: one device trained on the same global batches (all B rows a
    step), from the same seed. cfg: the model (default opts.gpt_config()); optimizer: default opts.optimizer."""
    cfg = cfg or opts.gpt_config()
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed)  # host: the parent's reference
    return train_single_device(cfg, batches, opts.seed, optimizer or opts.optimizer, opts.lr)


def mean_losses(outs: Sequence[dict], steps: int) -> list[float]:
    """The loss of each step as the mean of the ranks' losses: the loss over all B rows when every rank holds
    the same number of them (the mean of equal-sized means)."""
    return [sum(out["losses"][k] for out in outs) / len(outs) for k in range(steps)]


def compare_losses(what: str, ours: Sequence[float], reference: Sequence[float], dtype: Any, **kw: Any) -> Verdict:
    """The loss of each step against a reference, both as tensors of the run's dtype: compare() takes its
    tolerance from the dtype, so a float32 run is held to float32's, not float64's. kw: compare()'s."""
    return compare(what, host_values(ours, dtype), host_values(reference, dtype), **kw)


def one_device_checks(
    single: Any,
    dtype: Any,
    *,
    loss: tuple[str, Sequence[float]],
    grads: tuple[str, Any] | None = None,
    params: tuple[str, Any] | None = None,
    ranks: int | None = None,
) -> list[Verdict]:
    """The run against the single-device run `single`, in the order every report prints them: the loss of each
    step, the gradients of step 1, the parameters after the last step. Each is (verdict text, our values);
    grads or params None: not compared. ranks: our gradients and parameters are a list, one per rank, each
    compared with the one device's (a replicated scheme must agree on every rank, not only on rank 0)."""

    def theirs(value: Any) -> Any:
        return value if ranks is None else [value] * ranks

    checks = [compare_losses(loss[0], loss[1], single.losses, dtype)]
    if grads is not None:
        checks.append(compare(grads[0], grads[1], theirs(single.grads)))
    if params is not None:
        checks.append(compare(params[0], params[1], theirs(single.params)))
    return checks


def count_checks(rows: Sequence[tuple]) -> list[CountCheck]:
    """A table of counted figures turned into checks: one row (what, measured, theory) each, exact equality;
    a row (what, measured, theory, ">=") for a bound. A table reads as the list of claims a run makes."""
    return [check_equal(*row) if len(row) == 3 else CountCheck(*row) for row in rows]


MODEL_FIELDS = ("layers", "hidden", "heads", "ffn", "vocab", "seq", "batch", "dtype", "steps")


def model_fields(cfg: Any, opts: Any, *names: str) -> dict:
    """The model's and the run's sizes as report fields (layers, hidden, heads, ffn, vocab, seq, batch, dtype,
    steps), in the order asked (default: all of them, in that order), so every report spells them alike."""
    sizes = {
        "layers": cfg.layers,
        "hidden": cfg.hidden,
        "heads": cfg.heads,
        "ffn": cfg.ffn,
        "vocab": cfg.vocab_size,
        "seq": cfg.seq_len,
        "batch": opts.batch,
        "dtype": cfg.dtype,
        "steps": opts.steps,
    }
    return {name: sizes[name] for name in names or MODEL_FIELDS}
