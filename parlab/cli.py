"""The command line: `python -m parlab ...` (or `parlab ...`).

    python -m parlab list                              the schemes that exist
    python -m parlab run SCHEME --world N [--json]     run one scheme, print its verdict lines (or one JSON object)
    python -m parlab tour                              every scheme at world size 4, one verdict line each
    python -m parlab grade NOTEBOOK... [--json]        re-execute lab notebooks, print a score table

The same `run` works as one rank of a torchrun job, on one machine or many:
    torchrun --standalone --nproc-per-node 4 -m parlab run collectives
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from parlab import grade
from parlab.models import DTYPES
from parlab.schemes import COMMON_DEFAULTS, all_schemes, run_scheme, summary_line


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parlab", description="parlab: parallel training, one scheme at a time.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the schemes")
    tour = commands.add_parser("tour", help="run every scheme at world size 4, one verdict line each")
    tour.add_argument("--world", type=int, default=4)
    grade.build_parser(commands.add_parser("grade", help="re-execute lab notebooks and score their checks"))
    run = commands.add_parser("run", help="run one scheme and check it against a single device")
    schemes = run.add_subparsers(dest="scheme", required=True, metavar="SCHEME")
    for name, scheme in all_schemes().items():
        sub = schemes.add_parser(name, help=scheme.help, description=scheme.help)
        sub.add_argument("--world", type=int, default=COMMON_DEFAULTS["world"], help="number of ranks")
        sub.add_argument("--json", action="store_true", help="print one JSON object instead of verdict lines")
        sub.add_argument("--dtype", choices=sorted(DTYPES), default=COMMON_DEFAULTS["dtype"])
        sub.add_argument("--steps", type=int, default=COMMON_DEFAULTS["steps"], help="training steps")
        sub.add_argument("--seed", type=int, default=COMMON_DEFAULTS["seed"])
        if scheme.add_arguments is not None:
            scheme.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        for name, scheme in all_schemes().items():
            print(f"{name:14s} {scheme.help}")
        return 0
    if args.command == "grade":
        return grade.run(args)
    if args.command == "tour":
        ok = True
        for name in all_schemes():
            report = run_scheme(name, world=args.world)
            print(summary_line(report), flush=True)
            ok &= report["passed"]
        return 0 if ok else 1
    opts = {k: v for k, v in vars(args).items() if k not in ("command", "scheme", "json")}
    try:
        report = run_scheme(args.scheme, **opts)
    except ValueError as exc:  # bad options: said before any process started
        print(f"parlab: error: {exc}", file=sys.stderr)
        return 2
    if report is None:  # a rank other than 0 under torchrun: rank 0 speaks for the job
        return 0
    if args.json:
        print(json.dumps(_json_safe(report)))
    else:
        for line in report["verdicts"]:
            print(line)
    return 0 if report["passed"] else 1
