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

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "parlab"


def pytest_sessionstart(session) -> None:
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller has compiled it already
        return
    compileall.compile_dir(PACKAGE, quiet=1, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH, workers=1)


# Longest first (the classic longest-processing-time rule): with a few workers (`-n 3 --dist loadgroup`, the README's
# command) a long file that starts last keeps one worker busy alone at the end. Seconds of each file run alone
# (serially, on the 2-core machine; only the order matters, and a file missing here goes after these, in pytest's
# order). pytest-xdist would reorder the files by their number of tests instead (its default, which put the
# 2-test browser file last): that is turned off below.
SECONDS_ALONE = {
    "test_grade_run.py": 136,
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
    version = tuple(int(part) for part in pytest.__version__.split(".")[:2] if part.isdigit())
    if getattr(config.option, "dist", "no") == "loadgroup" and version >= (9, 2):
        # pytest 9.2 keeps node ids apart from the field pytest-xdist 3.8 writes its groups into: the groups are
        # dropped without a word, and a notebook's cells run one per worker, each in a fresh kernel, failing by the
        # hundred on NameError (pytest-xdist issue #1386).
        raise pytest.UsageError(
            f"pytest {pytest.__version__} drops pytest-xdist's loadgroup groups (pytest-xdist issue #1386): "
            'install pytest<9.2 (pip install -e ".[dev]") or run with --dist loadfile'
        )
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist is installed: keep the order set below
        config.option.loadscopereorder = False


# The wrong answers of each lab are a group of their own (a file of several minutes would otherwise keep one worker
# busy alone at the end): seconds per lab's wrong answers, run alone, as above.
WRONG_ANSWERS = "test_wrong_answers.py"
SECONDS_PER_WRONG_ANSWER = 8


def _group(item) -> str:
    """The xdist group of a test (`--dist loadgroup`, the README's command): its file, as `--dist loadfile` would
    (a module's fixtures are made once, on one worker), except that each lab's wrong answers form a group of their
    own."""
    path = Path(str(item.fspath))
    if path.name == WRONG_ANSWERS and hasattr(item, "callspec"):
        return f"{WRONG_ANSWERS}::{item.callspec.id.split('__')[0]}"
    return str(path)


# tryfirst: pytest-xdist's worker reads the xdist_group marks in its own pytest_collection_modifyitems (it appends
# "@group" to each node id, which is what loadgroup schedules by), so the marks must be there before it runs. (The
# 287 cells CI saw failing on NameError had another cause: pytest 9.2, refused in pytest_configure above.)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:

    groups: dict[str, int] = {}
    for item in items:
        group = _group(item)
        item.add_marker(pytest.mark.xdist_group(group))
        groups[group] = groups.get(group, 0) + 1

    def seconds(item) -> int:
        group = _group(item)
        if group.startswith(f"{WRONG_ANSWERS}::"):
            return SECONDS_PER_WRONG_ANSWER * groups[group]
        return SECONDS_ALONE.get(Path(str(item.fspath)).name, 0)

    items.sort(key=seconds, reverse=True)  # (stable: each group keeps its own order, the rest pytest's)
