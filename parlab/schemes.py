"""The registry of parallelism schemes, and one way to run any of them: `run_scheme`.

A scheme module (parlab/data_parallel.py, ...) declares what it offers as a module-level list:

    SCHEMES = [Scheme(name="dp", help="...", rank_fn=dp_rank, report=dp_report, add_arguments=..., check=...)]

- `check(opts)` rejects bad options with a clear ValueError before any process starts;
- `rank_fn(opts)` is the rank code: it runs on every rank (under parlab.launch or torchrun) and returns a value;
- `report(opts, results)` runs once, in the parent (or on rank 0 under torchrun): it runs the single-device
  reference, compares, and returns the report dict (see REQUIRED_KEYS) that the CLI prints or emits as JSON.

`opts` is a plain dict: the CLI's options (`world`, `dtype`, `steps`, `seed`, plus the scheme's own).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from parlab.launch import Results, init_from_env, launch, under_torchrun
from parlab.trace import Trace

# Modules that may define schemes, in the order of the lessons. A module that does not exist yet is skipped.
SCHEME_MODULES = [
    "parlab.collectives",
    "parlab.data_parallel",
    "parlab.tensor_parallel",
    "parlab.pipeline",
    "parlab.sequence_parallel",
    "parlab.zero",
    "parlab.offload",
    "parlab.hybrid",
]

REQUIRED_KEYS = ("scheme", "world_size", "passed", "max_abs_err", "tol", "comm", "verdicts")

COMMON_DEFAULTS = {"world": 4, "dtype": "float64", "steps": 3, "seed": 0}


@dataclass
class Scheme:
    name: str
    help: str
    rank_fn: Callable[[dict], Any]
    report: Callable[[dict, Results], dict]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    check: Callable[[dict], None] | None = None
    defaults: dict | None = None  # the scheme's own option defaults (used when called from Python)


def all_schemes() -> dict[str, Scheme]:
    """Every scheme whose module exists, by name."""
    found: dict[str, Scheme] = {}
    for module_name in SCHEME_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        for scheme in getattr(module, "SCHEMES", []):
            found[scheme.name] = scheme
    return found


def get_scheme(name: str) -> Scheme:
    schemes = all_schemes()
    if name not in schemes:
        raise ValueError(f"unknown scheme {name!r}; available: {', '.join(schemes)}")
    return schemes[name]


def options_for(scheme: Scheme, **opts) -> dict:
    """The full option dict: common defaults, then the scheme's defaults, then what the caller gave."""
    return {**COMMON_DEFAULTS, **(scheme.defaults or {}), **opts}


def run_scheme(name: str, **opts) -> dict | None:
    """Run a scheme on `opts["world"]` ranks and return its report (None on ranks > 0 under torchrun)."""
    if not under_torchrun():
        return launch_scheme(name, **opts)[1]
    scheme = get_scheme(name)
    opts = options_for(scheme, **opts)
    if scheme.check is not None:
        scheme.check(opts)
    results = _run_under_torchrun(scheme, opts)
    return None if results is None else _checked_report(scheme, opts, results)


def launch_scheme(name: str, **opts) -> tuple[Results, dict]:
    """Run a scheme on `opts["world"]` ranks with parlab.launch; returns (results, report).

    This is what the notebooks call (through each scheme's run_... function): the same run as
    `python -m parlab run NAME`, with the ranks' results and trace kept for drawing.
    """
    scheme = get_scheme(name)
    opts = options_for(scheme, **opts)
    if scheme.check is not None:
        scheme.check(opts)  # bad options are refused here, before any process starts
    results = launch(scheme.rank_fn, opts["world"], opts, echo=False)
    return results, _checked_report(scheme, opts, results)


def _checked_report(scheme: Scheme, opts: dict, results: Results) -> dict:
    report = scheme.report(opts, results)
    missing = [k for k in REQUIRED_KEYS if k not in report]
    if missing:
        raise RuntimeError(f"scheme {scheme.name!r} returned a report without {missing}")
    return report


def _run_under_torchrun(scheme: Scheme, opts: dict) -> Results | None:
    """torchrun started this process as one rank: run the rank code, gather every rank's output on rank 0."""
    from parlab import comm

    init_from_env()
    if opts["world"] != dist.get_world_size():
        opts["world"] = dist.get_world_size()  # torchrun decides the world size
        if scheme.check is not None:
            scheme.check(opts)
    comm.reset_trace()
    value = scheme.rank_fn(opts)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((value, comm.trace_events()), gathered, dst=0)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return None
    values = [v for v, _ in gathered]
    trace = Trace([e for _, events in gathered for e in events], len(gathered))
    return Results(values, trace, [""] * len(gathered), 0.0)


def summary_line(report: dict) -> str:
    """One line per scheme for `python -m parlab tour`."""
    status = "PASS" if report["passed"] else "FAIL"
    relation = "matches single device" if report["passed"] else "DIFFERS from single device"
    return (
        f"{report['scheme']} (world {report['world_size']}): {relation}: "
        f"max |err| {report['max_abs_err']:.1e} vs tol {report['tol']:.0e}: {status}"
    )
