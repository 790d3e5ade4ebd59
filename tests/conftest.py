"""Set-up for the whole test session.

Bytecode. Where PYTHONDONTWRITEBYTECODE is set (as on this project's machines and CI), Python never caches parlab's
compiled modules, so every process that imports parlab compiles it from source again: every rank of every launch
(~20 ms of CPU for a scheme's modules), every notebook's kernel, every command-line run. The suite starts thousands
of them, so the session compiles the package once, first, into the usual __pycache__ folders, in "checked-hash"
mode: at each import Python checks the .pyc against the hash of its source, so an edited file never runs from a
stale .pyc (the reason ranks import parlab fresh from disk).
"""

from __future__ import annotations

import compileall
import py_compile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "parlab"


def pytest_sessionstart(session) -> None:
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller has compiled it already
        return
    compileall.compile_dir(PACKAGE, quiet=1, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH, workers=1)


# The files of a minute or more, first: with two workers (`-n 2 --dist loadfile`, the README's command), a long file
# that starts last keeps one worker busy alone at the end. (Within a file, and otherwise, the order is pytest's.)
LONG_FIRST = ("test_grade_run.py", "test_binder.py", "test_torchrun.py", "test_browser.py", "test_cli.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    def rank(item) -> int:
        name = Path(str(item.fspath)).name
        return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # (stable: each file keeps its own order)
