"""Run the command line inside the test's own process: `python -m parlab ...` without a fresh interpreter.

A subprocess pays for its own torch import and its own rank server (4-6 s here); in this process the command uses
the warm rank server of the test session (a launch takes a fraction of a second). What a subprocess test checks of
the command (its exit status, its stdout, its stderr) is the same: tests/test_cli.py keeps the end-to-end runs of
the real `python -m parlab` process (its exit statuses, Ctrl-C, an instant `list`)."""

from __future__ import annotations

import contextlib
import io
import subprocess

from parlab import cli


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m parlab ARGS` as cli.main runs it: (returncode, stdout, stderr), as subprocess.run would return."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(list(args))
        except SystemExit as exit_:  # argparse's usage errors: status 2 and its message on stderr
            status = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["parlab", *args], status, out.getvalue(), err.getvalue())
