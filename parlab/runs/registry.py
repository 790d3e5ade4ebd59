"""How a scheme is run and checked: the registry behind `python -m parlab run SCHEME` and the notebooks.

A scheme file (parlab/schemes/data_parallel.py, ...) holds the algorithm, its rank loop and its theory, and knows
nothing of this package. For each scheme, one module here holds the rest:

    parlab/runs/data_parallel.py
        DPOptions(ModelOptions)          the run's typed options: defaults and validation in one place
        dp_rank(opts) -> dict            the rank code: builds the model and data, calls the scheme's training loop
        dp_report(opts, results) -> dict the parent: the single-device reference, the verdicts, the measured bytes
        run_dp(world_size=4, **options)  a notebook's way to run it: (results, report)
        SCHEMES = [Scheme("dp", help, DPOptions, dp_rank, dp_report)]

`launch_scheme` runs any of them with parlab.launch (what the notebooks and the CLI do); `run_scheme` does the same
under torchrun too. Bad options raise a ValueError here, before any process starts.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from parlab.core import pace
from parlab.core.trace import Trace
from parlab.runs.options import RunOptions
from parlab.runtime import under_torchrun
from parlab.runtime.errors import Results
from parlab.runtime.launcher import init_from_env, launch
from parlab.runtime.server import warm_up

# Modules that may define schemes, in the order of the lessons. A module that does not exist (yet) is skipped.
RUN_MODULES = [
    "parlab.runs.collectives",
    "parlab.runs.data_parallel",
    "parlab.runs.tensor_parallel",
    "parlab.runs.pipeline",
    "parlab.runs.sequence_parallel",
    "parlab.runs.usp",
    "parlab.runs.zero",
    "parlab.runs.offload",
    "parlab.runs.hybrid",
    "parlab.runs.parameter_server",
    "parlab.runs.expert_parallel",
    "parlab.runs.checkpoint",
]

REQUIRED_KEYS = ("scheme", "world_size", "passed", "max_abs_err", "tol", "comm", "verdicts")


@dataclass(frozen=True)
class Scheme:
    """One runnable scheme: its CLI name, its options class, its rank code and its report.

    fixed: option values this scheme always runs with (e.g. {"mode": "dp-naive"}), not offered as CLI flags.
    failure: the kind of run `--kill-rank` makes of it (parlab/runs/checkpoint.py, `failure_run`), or None.
    quick: option values of its fastest run that still checks every part of it (`python -m parlab doctor --quick`).
    not_offered: options of its class this scheme does not take (e.g. recompute, where its model runs the blocks'
        layers itself): no CLI flag for them; a Python caller who sets one is refused by the options' validate.
    """

    name: str
    help: str
    options: type[RunOptions]
    rank_fn: Callable[[Any], Any]
    report: Callable[[Any, Results], dict]
    fixed: tuple[tuple[str, Any], ...] = ()
    failure: str | None = None
    quick: tuple[tuple[str, Any], ...] = (("steps", 1),)
    not_offered: tuple[str, ...] = ()

    def make_options(self, **values) -> RunOptions:
        """The validated options: the class defaults, then `values`, then what this scheme fixes."""
        return self.options.make(**{**values, **dict(self.fixed)}).check()

    def for_options(self, opts: RunOptions) -> Scheme:
        """This scheme as these options run it: with a rank killed (`--kill-rank`), the failure run's rank code and
        report (parlab/runs/checkpoint.py) in place of its own."""
        if self.failure is None or getattr(opts, "kill_rank", None) is None:
            return self
        from parlab.runs.checkpoint import failure_run

        rank_fn, report = failure_run(self.failure)
        return dataclasses.replace(self, rank_fn=rank_fn, report=report)


def all_schemes() -> dict[str, Scheme]:
    """Every scheme whose run module exists, by name, in the order of the lessons."""
    found: dict[str, Scheme] = {}
    for module_name in RUN_MODULES:
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


def launch_scheme(name: str, twin: bool = False, live: bool = False, **options) -> tuple[Results, dict]:
    """Run a scheme on `world_size` ranks with parlab.launch; returns (results, report).

    This is what the notebooks call (through each scheme's run_... function): the same run as
    `python -m parlab run NAME`, with the ranks' results and trace kept for drawing.
    twin: also run the scheme's PyTorch twin on the same ranks (parlab/twins), reported as report["twin"].
    live: draw the timeline while the ranks run (parlab.live); the finished timeline stays as the cell's output.
    """
    scheme = get_scheme(name)
    opts = scheme.make_options(**options)  # bad options are refused here, before any process starts
    scheme = scheme.for_options(opts)
    if live:
        from parlab.views.live import LiveTimeline

        with LiveTimeline(opts.world_size, title=f"{name} on {opts.world_size} ranks") as view:
            results, report = launch_scheme(name, twin=twin, **options)
            view.finish(results.trace)
        return results, report
    _while_the_server_starts()
    if not twin:
        results = launch(run_rank, opts.world_size, scheme.rank_fn, opts, echo=False)
        return results, checked_report(scheme, opts, results)
    from parlab.twins import registry as twins  # the twin runs in the same launch, right after the scheme's rank code

    results = launch(run_rank, opts.world_size, twins.with_twin(name, scheme.rank_fn), opts, echo=False)
    results, outs = twins.split(results)
    report = checked_report(scheme, opts, results)
    report["twin"] = twins.twin_report(name, opts, results, outs)
    return results, report


def _while_the_server_starts() -> None:
    """Start the rank server (if it is not running) and, while it imports torch in its own process, import here
    what the report will need: its single-device reference makes a torch.optim optimizer, and the first one in a
    process imports torch._dynamo (~3 s here). A cold command-line run paid both one after the other; in a warm
    notebook both are done already."""
    warm_up()
    importlib.import_module("torch._dynamo")


def run_rank(rank_fn: Callable[[Any], Any], opts: RunOptions) -> Any:
    """What each rank runs: the scheme's rank code, paced when the options ask for an emulated device and link."""
    with pace.paced(opts.pace_model()):
        return rank_fn(opts)


def run_scheme(name: str, twin: bool = False, **options) -> dict | None:
    """Run a scheme and return its report (None on ranks > 0 under torchrun, where rank 0 reports).
    twin: with its PyTorch twin (report["twin"]; under torchrun too)."""
    if not under_torchrun():
        return launch_scheme(name, twin=twin, **options)[1]
    scheme = get_scheme(name)
    init_from_env()
    opts = scheme.make_options(**{**options, "world_size": dist.get_world_size()})  # torchrun decides the size
    scheme = scheme.for_options(opts)
    if twin:  # the same wrapping as launch_scheme's
        from parlab.twins import registry as twins

        scheme = dataclasses.replace(scheme, rank_fn=twins.with_twin(name, scheme.rank_fn))
    results = _run_under_torchrun(scheme, opts)
    if results is None:
        return None
    if not twin:
        return checked_report(scheme, opts, results)
    results, outs = twins.split(results)
    return {**checked_report(scheme, opts, results), "twin": twins.twin_report(name, opts, results, outs)}


def checked_report(scheme: Scheme, opts: RunOptions, results: Results) -> dict:
    report = scheme.report(opts, results)
    missing = [k for k in REQUIRED_KEYS if k not in report]
    if missing:
        raise RuntimeError(f"scheme {scheme.name!r} returned a report without {missing}")
    model = opts.pace_model()
    report["paced"] = None if model is None else model.describe()
    if model is not None:  # every figure of a paced run says so, and whether the machine kept up with the pace
        overran = pace.overruns(results.trace.events)
        report["paced_overruns"] = overran
        note = f"paced run ({model.describe()}): times are modelled, data and bytes are real"
        if overran and model.latency_bound:  # F is short on purpose: a message's latency sets the slow-down
            note += (
                f"; {overran} compute spans took longer than modelled: on an {model.profile.upper()} this model's "
                f"forward is shorter than a message's latency, so F lasts only {model.unit * 1e3:.3g} ms here, less "
                "than this machine needs; a bigger model (--hidden, --seq, --batch) lengthens it"
            )
        elif overran:
            note += (
                f"; {overran} compute spans took longer than modelled (pace too fast for this machine: "
                "a larger unit slows it down, e.g. --pace unit=100ms or --pace h100,unit=200ms)"
            )
        report["verdicts"] = [*report["verdicts"], note]
    return report


def _run_under_torchrun(scheme: Scheme, opts: RunOptions) -> Results | None:
    """torchrun started this process as one rank: run the rank code, gather every rank's output on rank 0."""
    from parlab.core import comm

    comm.reset_trace()
    value = run_rank(scheme.rank_fn, opts)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((value, comm.trace_events()), gathered, dst=0)
    rank = dist.get_rank()  # (the process group stays for the next scheme this process runs: see init_from_env)
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
