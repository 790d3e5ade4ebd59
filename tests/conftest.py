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


# Longest first (the classic longest-processing-time rule): with a few workers (`-n 3 --dist loadfile`, the README's
# command) a long file that starts last keeps one worker busy alone at the end. Seconds of each file run alone
# (serially, on the 2-core machine; only the order matters, and a file missing here goes after these, in pytest's
# order). pytest-xdist would reorder the files by their number of tests instead (its default, which put the
# 2-test browser file last): that is turned off below.
SECONDS_ALONE = {
    "test_grade_run.py": 136,
    "test_wrong_answers.py": 78,
    "test_binder.py": 72,
    "test_launch_failures.py": 68,
    "test_browser.py": 65,
    "test_cli.py": 35,
    "03_pipeline_parallel.ipynb": 28,
    "test_doctor.py": 60,
    "test_torchrun.py": 25,
    "test_launch_warm.py": 22,
    "test_offload.py": 19,
    "test_failures.py": 17,
    "test_notebook_execution.py": 16,
    "05_zero.ipynb": 15,
    "08_parameter_server.ipynb": 15,
    "07_hybrid.ipynb": 15,
    "test_launch.py": 15,
    "test_edges.py": 15,
    "02_tensor_parallel.ipynb": 14,
    "04_sequence_parallel.ipynb": 14,
}


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist is installed: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items) -> None:
    def seconds(item) -> int:
        return SECONDS_ALONE.get(Path(str(item.fspath)).name, 0)

    items.sort(key=seconds, reverse=True)  # (stable: each file keeps its own order, the rest pytest's)
