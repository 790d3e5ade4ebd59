"""The labs' checks, split so that a grade never depends on code a submission can change.

Every lab (labs/solutions/labNN_name.ipynb) has a module here, parlab/grading/labs/labNN_name.py, with two functions
per check cell `# CHECK: name (N points)`:

    collect_<name>(*answers) -> dict     runs in the notebook's kernel: launches the student's code on live ranks
                                         and returns what they produced, as plain data (tensors, numbers, strings,
                                         lists and dicts of them)
    judge_<name>(data) -> list[str]      runs wherever the verdict is decided: recomputes the single-device
                                         reference itself and returns the verdict lines ("...: PASS" / "...: FAIL")

and a `STRUCTURAL` dict: for each check, the structural property it verifies beyond "the numbers are right" (e.g.
lab 00: the sum was computed by the student's own ring). A check cell is one line, `checks.run("name", answer)`:

- a student running the notebook (or `pytest --nbval`) gets collect, then judge, in the kernel: the verdict lines
  are printed under the cell, and the stored ones are what a correct answer prints;
- under `python -m parlab grade` (the environment variable PARLAB_GRADE_OUT is set) the kernel only collects and
  saves the data to a file (torch.save); the grader, a separate process that never runs student code, reads it
  back with `torch.load(weights_only=True)` (no code runs on reading) and judges it itself (parlab/grading/command.py).

So an answer cell that redefines `parlab.compare`, a check helper or this module's functions in its kernel changes
nothing the grader computes. What it can still do is hand the grader forged data: see labs/README.md for what the
grader does and does not protect against.

`LABS` is the fixed list of official labs: the grader identifies a submission's lab by looking its name up here,
never by a path taken from the submission.
"""

from __future__ import annotations

import contextvars
import importlib
import math
import os
import re
from pathlib import Path

from parlab.core.check import CheckFailed

LABS = (
    "lab00_ring_allreduce",
    "lab01_data_parallel",
    "lab02_tensor_parallel",
    "lab03_pipeline_1f1b",
    "lab04_ring_attention",
    "lab05_zero",
    "lab06_offload",
    "lab07_hybrid",
    "lab08_parameter_server",
    "lab09_expert_parallel",
    "lab10_pytorch_twins",
    "lab11_fault_tolerance",
    "lab_bug_hunt",
)

OUT_ENV = "PARLAB_GRADE_OUT"  # set by the grader: the folder the kernel saves each check's data in


def checks_module(lab: str):
    """The module with lab `lab`'s collect_/judge_ functions (only names from LABS)."""
    if lab not in LABS:
        raise KeyError(f"unknown lab {lab!r}")
    return importlib.import_module(f"parlab.grading.labs.{lab}")


def check_function(module, kind: str, check: str):
    """`collect_<check>` or `judge_<check>` of a lab: in the lab's module, else in one of the modules it names in
    `PARTS` (a lab whose checks are written in several files)."""
    for part in (module, *getattr(module, "PARTS", ())):
        found = getattr(part, f"{kind}_{check}", None)
        if found is not None:
            return found
    raise AttributeError(f"{module.__name__} has no {kind}_{check} (nor has any module of its PARTS)")


def judge(module, check: str, data, *, graded: bool = False) -> list[str]:
    """The verdict lines of one check, from the data its collect step returned. graded=True: the grader's own
    judgement, after which nothing can be changed, so a wrong prediction's lines show the theory and the
    measurement too (in a student's notebook they stay hidden until the prediction is right)."""
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return [f"{check}: the check did not complete ({data['error']}): FAIL"]
    import torch

    # The references are tiny: one thread is several times faster than two on a loaded 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    token = _GRADED.set(graded)
    try:
        return [str(line) for line in check_function(module, "judge", check)(data)]
    finally:
        _GRADED.reset(token)
        torch.set_num_threads(threads)


def run_check(module_name: str, check: str, *answers) -> None:
    """A check cell's body: collect on live ranks, then judge and print (or, when graded, save the data)."""
    module = importlib.import_module(module_name)
    collect = check_function(module, "collect", check)
    out = os.environ.get(OUT_ENV)
    if not out:  # a student's own run (or pytest --nbval): judge here, and fail the cell if a verdict failed
        lines = judge(module, check, collect(*answers))
        for line in lines:
            print(line)
        failed = [line for line in lines if line.endswith(": FAIL")]
        if failed:
            raise CheckFailed(f"{len(failed)} of {len(lines)} verdicts of check {check!r} FAIL (the lines above)")
        return
    import torch

    path = Path(out) / f"{check}.pt"
    try:
        data = collect(*answers)
    except Exception as exc:  # the reason goes to the grader too; the cell still shows the error
        torch.save({"error": error_summary(exc)}, path)
        raise
    torch.save(data, path)
    print(f"{check}: collected for the grader")


# ------------------------------------------------------------------------------------------ graded predictions

# True while the grader judges a submission (judge(..., graded=True)): the grade is being decided from data the
# notebook can no longer change, so a wrong prediction's feedback may show the numbers it should have found.
_GRADED: contextvars.ContextVar[bool] = contextvars.ContextVar("parlab_graded", default=False)


def _number(value) -> float | None:
    """A prediction as a float, or None when it is not one finite number (a string, a list, nan, a bool)."""
    if isinstance(value, (bool, str, bytes)):  # True is not 1 byte, "6144" is not a number
        return None
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _shown(value) -> str:
    number = _number(value)
    if number is None:
        return repr(value)[:40]
    return f"{number:,.0f}" if number == int(number) and abs(number) < 1e15 else f"{number:.4g}"


def prediction_lines(label: str, predicted, theory: float, measured=None, rtol: float = 0.05) -> list[str]:
    """The lines of one graded prediction: what was predicted, the theory and the measurement side by side (shown,
    not scored; in the student's notebook the theory and the measurement only once the prediction is right, so that
    a wrong one cannot be copied from them; in the grader's feedback always, the grade being decided), then the
    verdicts: the prediction within `rtol` of the theory the judge computed itself, and (when a measurement is
    given) the measurement equal to the theory.

    The first line carries no verdict, so a prediction that is right but not the solution's own number still
    scores: the verdict lines are the same for every prediction within the tolerance."""
    number = _number(predicted)
    within = f"within {rtol:.0%} of theory" if rtol >= 0.01 else f"within {rtol:.1%} of theory"
    within = "equals theory" if rtol == 0 else within
    ok = number is not None and abs(number - theory) <= rtol * abs(theory) + (1e-12 if theory == 0 else 0.0)
    # The theory and the measurement are the answer: shown once the prediction is right, not to copy from.
    columns = f"predicted {_shown(predicted)} | theory {_shown(theory)}"
    if measured is not None:
        columns += f" | measured {_shown(measured)}"
    if not ok and not _GRADED.get():
        columns = f"predicted {_shown(predicted)} | theory and measurement shown once the prediction is right"
    lines = [f"{label}: {columns}"]
    if number is None:
        lines.append(f"{label}: prediction is not a finite number ({type(predicted).__name__}): FAIL")
    elif ok:
        lines.append(f"{label}: prediction {within}: PASS")
    elif _GRADED.get():  # the grader keeps verdict lines only: the numbers go on the FAIL line itself
        lines.append(f"{label}: prediction {within}: predicted {_shown(predicted)}, theory {_shown(theory)}: FAIL")
    else:
        lines.append(f"{label}: prediction {within}: FAIL")
    if measured is not None:
        value = _number(measured)
        ok = value is not None and abs(value - theory) <= 1e-9 * max(abs(theory), 1.0)
        lines.append(f"{label}: measured equals theory: {'PASS' if ok else 'FAIL'}")
    return lines


# ------------------------------------------------------------------------------------------ reasons, in a line

# Lines that say what went wrong, in the order they are preferred (gloo's messages, then Python's exception line).
_INFORMATIVE = [
    re.compile(r"(mismatch|doesn't match|does not match|Connection closed by peer|enforce fail)", re.I),
    re.compile(r"^\s*what\(\):\s*\S"),
    re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Timeout)\b.*"),
    re.compile(r"(terminate called|Aborted|Segmentation fault|Killed)"),
]


def informative_line(text: str, limit: int = 240) -> str:
    """The first line of an error text (a traceback, a rank's stderr) that says what went wrong, or ''."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in _INFORMATIVE:
        hits = [line for line in lines if pattern.search(line) and "Warning" not in line]
        if hits:
            # For a Python traceback the exception line is the last one; for the others the first is the cause.
            line = hits[-1] if pattern is _INFORMATIVE[2] else hits[0]
            return line[:limit]
    return ""


def p2p_events(since: float) -> list[dict]:
    """Rank side: this rank's sends and receives traced by parlab.core.comm and issued after `since` (a
    time.perf_counter() reading): kind, peer, bytes, when issued (start) and when waited for (end; -1.0: never)."""
    from parlab.core import comm

    return [
        {
            "kind": e.kind,
            "peer": -1 if e.peer is None else int(e.peer),
            "bytes": int(e.bytes),
            "start": e.start,
            "end": -1.0 if e.end is None else e.end,
        }
        for e in comm.trace_events()
        if e.kind in ("send", "recv") and e.start >= since
    ]


def error_summary(exc: BaseException) -> str:
    """One line for an exception a check raised: for a failing rank, its number and the rank's own error."""
    from parlab.runtime.errors import RankError

    if isinstance(exc, RankError):
        # The reason first: a collective mismatch gloo reported on another rank's stderr (parlab.launch).
        line = (
            informative_line(f"{exc.reason}\n{exc.remote_traceback}") or exc.remote_traceback.strip().splitlines()[-1:]
        )
        return f"rank {exc.rank} failed: {line if isinstance(line, str) else ' '.join(line)}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()[:300]
