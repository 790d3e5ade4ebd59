"""The command line: `python -m parlab ...` (or `parlab ...`).

    python -m parlab list                              the schemes that exist
    python -m parlab run SCHEME --world N [--json]     run one scheme, print its verdict lines (or one JSON object)
    python -m parlab tour [--world N]                  every scheme that runs at world size N, one verdict line each
    python -m parlab grade NOTEBOOK... [--json]        re-execute lab notebooks, print a score table
    python -m parlab plan --layers L --hidden H ...     which DP x TP x PP (+ SP, ZeRO, offload) fits a cluster
    python -m parlab figures --lesson 03 --out DIR      a lesson's figures as standalone HTML (+ PNG/SVG) files
    python -m parlab doctor [--quick] [--json]          this machine, a launch's phases, every scheme and its twin

The same `run` works as one rank of a torchrun job, on one machine or many:
    torchrun --standalone --nproc-per-node 4 -m parlab run collectives

Bad options are refused with one `parlab: error: ...` line (exit status 2) before any process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import sys
import threading

from parlab.runs.catalog import CATALOG

# Each command imports what it needs when it runs: `list`, `plan`, `figures` and `--help` never import torch.


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one `parlab: error: ...` line."""

    def error(self, message: str):
        self.exit(2, f"parlab: error: {message} (see: {self.prog} --help)\n")


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (`command` given) one whose other commands are only named: building `grade`'s options
    or `run`'s schemes imports torch, which only those commands pay for."""
    parser = _Parser(prog="parlab", description="parlab: parallel training, one scheme at a time.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands.add_parser("list", help="list the schemes")
    tour = commands.add_parser("tour", help="run every scheme that accepts the world size, one verdict line each")
    tour.add_argument("--world", type=int, default=4, help="number of ranks (default 4)")
    tour.add_argument("--no-twin", dest="twin", action="store_false", help="skip the PyTorch twins (parlab/twins)")
    doctor = commands.add_parser(
        "doctor",
        help="check this machine: every scheme at the largest world it allows, with its twin, and a launch's phases",
        description="Reports the machine (CPUs, GPUs, torch, CUDA, NCCL, gloo, the grading sandbox), times the "
        "phases of a launch, and runs every scheme at the largest world size the machine allows (one GPU per rank "
        "on NCCL, else 4 ranks on gloo) with its PyTorch twin. Exit status 0 when every scheme passes.",
    )
    doctor.add_argument("--quick", action="store_true", help="each scheme's fastest run that still checks it")
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    doctor.add_argument("--json-file", metavar="PATH", help="also write that JSON object to PATH")
    doctor.add_argument("--no-twin", dest="twin", action="store_false", help="skip the PyTorch twins")
    doctor.add_argument("--only", nargs="+", metavar="SCHEME", help="these schemes only (default: every one)")
    grade_parser = commands.add_parser("grade", help="re-execute lab notebooks and score their checks")
    if command in (None, "grade"):
        from parlab.grading import command as grade

        grade.build_parser(grade_parser)
    from parlab.lessons import figures  # no torch or plotly at import: `figures` stays fast

    figures.add_arguments(commands.add_parser("figures", help="write a lesson's figures as HTML (and PNG/SVG) files"))
    plan = commands.add_parser("plan", help="estimate memory and communication of every way to parallelise a model")
    add_plan_arguments(plan)
    run = commands.add_parser("run", help="run one scheme and check it against a single device")
    schemes = run.add_subparsers(dest="scheme", required=True, metavar="SCHEME", parser_class=_Parser)
    if command not in (None, "run"):
        return parser
    from parlab.runs.registry import all_schemes

    for name, scheme in all_schemes().items():
        sub = schemes.add_parser(name, help=scheme.help, description=scheme.help)
        sub.add_argument("--json", action="store_true", help="print one JSON object instead of verdict lines")
        twin_help = "skip the PyTorch twin (parlab/twins) run after the scheme on the same ranks"
        sub.add_argument("--no-twin", dest="twin", action="store_false", help=twin_help)
        scheme.options.add_arguments(sub, skip={*dict(scheme.fixed), *scheme.not_offered})
    return parser


def _error(message: str) -> int:
    print(f"parlab: error: {message}", file=sys.stderr)
    return 2


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model (a GPT)")
    for name, default in (("layers", 96), ("hidden", 12288), ("heads", 96), ("seq", 2048), ("vocab", 51200)):
        model.add_argument(f"--{name}", type=int, default=default, help=f"(default {default}: GPT-3 175B)")
    model.add_argument("--untied", action="store_true", help="a separate LM head matrix (default: tied)")
    model.add_argument("--experts", type=int, default=0, help="E experts per block instead of the MLP (0: dense)")
    model.add_argument("--top-k", type=int, default=1, help="k experts per token (with --experts)")
    search = parser.add_argument_group("what to try besides dp x tp x pp, SP, ZeRO and offload")
    search.add_argument("--cp", type=int, nargs="+", default=[1], help="context-parallel sizes (e.g. 1 2 4)")
    search.add_argument("--recompute", nargs="+", default=["none"], choices=["none", "selective", "full"])
    cluster = parser.add_argument_group("the cluster and the batch")
    cluster.add_argument("--devices", type=int, default=1024)
    cluster.add_argument("--memory", type=float, default=80, help="GB per device (default 80)")
    cluster.add_argument("--devices-per-node", type=int, default=8)
    cluster.add_argument("--batch", type=int, default=1536, help="global batch, sequences")
    cluster.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--top", type=int, default=10, help="how many plans to print")


def plan(args: argparse.Namespace) -> int:
    from parlab.schemes.hybrid.planner import Cluster, ModelSpec, describe, plans

    names = ("layers", "hidden", "heads", "seq", "vocab", "devices", "devices_per_node", "batch", "top")
    sizes = {k: getattr(args, k) for k in names}
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in {**sizes, "micro_batch": args.micro_batch}.items() if v < 1]
    if bad:
        return _error(f"{', '.join(bad)}: must be positive")
    if not 0 < args.memory < math.inf:  # false for nan
        return _error(f"--memory {args.memory}: must be a positive finite number of GB")
    if args.hidden % args.heads:  # as `run` refuses it: every head gets hidden / heads features
        return _error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.experts < 0 or not 1 <= args.top_k <= max(args.experts, 1) or min(args.cp) < 1:
        return _error(f"--experts {args.experts} --top-k {args.top_k} --cp {args.cp}: need 1 <= k <= E, cp >= 1")
    model = ModelSpec(
        args.layers,
        args.hidden,
        args.heads,
        args.seq,
        args.vocab,
        tied=not args.untied,
        experts=args.experts,
        top_k=args.top_k,
    )
    cluster = Cluster(args.devices, args.memory * 1e9, args.devices_per_node)
    found = plans(model, cluster, args.batch, args.micro_batch, cps=tuple(args.cp), recomputes=tuple(args.recompute))
    if not found:
        return _error("no DP x TP x PP divides this model, cluster and batch (check heads, layers, batch)")
    print(
        f"{model.params() / 1e9:.1f}B parameters on {args.devices} devices of {args.memory:g} GB; "
        f"{sum(e.fits for e in found)} of {len(found)} plans fit (mixed precision Adam: 2 + 2 + 12 bytes/param)"
    )
    for estimate in found[: args.top]:
        print(describe(estimate))
    return 0


def tour(world_size: int, twin: bool = True) -> int:
    """Every scheme at `world_size` with its default options; the ones whose options refuse it are skipped, with
    the reason. Every option is checked before the first scheme runs."""
    if world_size < 1:
        return _error(f"--world {world_size}: the number of ranks must be >= 1")
    from parlab.runs.registry import all_schemes, run_scheme, summary_line
    from parlab.twins.registry import twin_line

    runnable, skipped = [], []
    for name, scheme in all_schemes().items():
        try:
            scheme.make_options(world_size=world_size)
            runnable.append(name)
        except ValueError as exc:
            skipped.append(f"{name} skipped at world size {world_size}: {exc}")
    if not runnable:
        return _error(f"--world {world_size}: no scheme runs at this world size")
    ok = True
    for name in runnable:
        report = run_scheme(name, world_size=world_size, twin=twin)
        print(summary_line(report), flush=True)
        if twin:  # the same run beside its PyTorch twin (parlab/twins), indented under the scheme's line
            print(f"  {twin_line(report)}", flush=True)
        ok &= report["passed"] and report.get("twin", {}).get("passed") is not False
    for line in skipped:
        print(line)
    return 0 if ok else 1


def doctor(args: argparse.Namespace) -> int:
    """`python -m parlab doctor`: checked here, before any process starts; parlab/doctor.py does the rest."""
    from parlab.runtime import under_torchrun

    if under_torchrun():
        return _error("doctor starts its own ranks (parlab.launch): run it without torchrun")
    if args.only:
        from parlab.runs.registry import all_schemes

        unknown = [name for name in args.only if name not in all_schemes()]
        if unknown:
            return _error(f"--only {' '.join(unknown)}: no such scheme; available: {', '.join(all_schemes())}")
    from parlab import doctor as checks

    if args.json_file and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_file))):
        return _error(f"--json-file {args.json_file}: its folder does not exist")
    report = checks.doctor(quick=args.quick, twin=args.twin, only=args.only, echo=not args.json)
    text = json.dumps(_json_safe(report))
    if args.json:
        print(text)
    if args.json_file:
        with open(args.json_file, "w") as f:
            f.write(text + "\n")
    return 0 if report["passed"] else 1


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised in the main thread, so that the run unwinds as after Ctrl-C (launch stops
    the ranks, `finally` blocks remove scratch folders, atexit shuts the rank server down)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _orderly_signals():
    """SIGTERM and SIGHUP (a closed terminal, `kill`, a job scheduler) end the command as Ctrl-C does, with nothing
    left behind, instead of killing it on the spot; the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():  # (only the main thread may set handlers)
        yield
        return

    def handler(signum, frame):
        raise _Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def main(argv: list[str] | None = None) -> int:
    """The command line's exit status: a command's own, 130 after Ctrl-C, 128 + N after signal N (SIGTERM,
    SIGHUP), 1 when stdout was closed early (`parlab plan | head -2`), each without a traceback."""
    try:
        with _orderly_signals():
            return _main(argv)
    except KeyboardInterrupt:  # the ranks were stopped by launch's own handler; say it in one line
        print("parlab: interrupted", file=sys.stderr)
        return 130
    except _Terminated as stop:
        print(f"parlab: stopped by {signal.Signals(stop.signum).name}", file=sys.stderr)
        return 128 + stop.signum
    except BrokenPipeError:
        # The reader left: point stdout at /dev/null so the interpreter's last flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


@contextlib.contextmanager
def _progress_lines():
    """While a command runs ranks: their progress on stderr even where it is no terminal (a pipe, a log), as a line
    now and then (parlab/runtime/progress.py); a terminal or a notebook shows it as always."""
    from parlab.runtime.progress import _ProgressLine

    before, _ProgressLine.LINES = _ProgressLine.LINES, True
    try:
        yield
    finally:
        _ProgressLine.LINES = before


def _in_flags(message: str, scheme: str) -> str:
    """An options error as the command line spells it: `world_size=4` (the Python API's field) becomes `--world 4`."""
    from dataclasses import fields

    from parlab.runs.registry import all_schemes

    for f in fields(all_schemes()[scheme].options):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        message = re.sub(rf"(?<![\w.-]){f.name}=", f"{flag} ", message)  # world_size=4: --world 4
        message = re.sub(rf"(?<![\w.-]){f.name}(?= [<>]=? )", flag, message)  # world_size >= 2: --world >= 2
    return message


def _main(argv: list[str] | None) -> int:
    words = sys.argv[1:] if argv is None else argv
    command = next((word for word in words if not word.startswith("-")), "")  # "": none given (e.g. --help)
    args = build_parser(command).parse_args(argv)
    if args.command == "list":
        for name, help_line in CATALOG:
            print(f"{name:14s} {help_line}")
        return 0
    if args.command == "grade":
        from parlab.grading import command as grade

        return grade.run(args)
    if args.command == "tour":
        with _progress_lines():
            return tour(args.world, args.twin)
    if args.command == "doctor":
        return doctor(args)
    if args.command == "figures":
        from parlab.lessons import figures

        return figures.main(args)
    if args.command == "plan":
        return plan(args)
    from parlab.runs.registry import run_scheme
    from parlab.runtime.errors import LaunchTimeout, RankError

    options = {k: v for k, v in vars(args).items() if k not in ("command", "scheme", "json", "twin")}
    try:
        with _progress_lines():
            report = run_scheme(args.scheme, twin=args.twin, **options)
    except ValueError as exc:  # bad options: said before any process started
        return _error(_in_flags(str(exc), args.scheme))
    except (RankError, LaunchTimeout) as exc:  # the ranks' own story (a rank's traceback, who waited where)
        print(f"parlab: error: {exc}", file=sys.stderr)
        return 1
    if report is None:  # a rank other than 0 under torchrun: rank 0 speaks for the job
        return 0
    # A twin that ran and disagrees fails the run: the JSON's "passed" says what the exit status says (the scheme's
    # own verdict against one device stays in "scheme_passed").
    twin_failed = report.get("twin", {}).get("passed") is False
    passed = report["passed"] and not twin_failed
    if args.json:
        print(json.dumps(_json_safe({**report, "passed": passed, "scheme_passed": report["passed"]})))
    else:
        for line in report["verdicts"]:
            print(line)
        if "twin" in report:
            from parlab.twins.registry import twin_line

            print(twin_line(report))
    return 0 if passed else 1
