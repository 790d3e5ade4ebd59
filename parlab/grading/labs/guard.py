"""Rank side: see whether an answer calls parlab's own implementation of what its part asks for.

A lab asks a student to write something the library also has (a ring, Megatron's f and g, a ZeRO stage...). An
answer that imports or pastes-and-calls the library's version has not written it. Each lab declares, once, what
its parts must not call (`LIBRARY` in its module: files or folders of the package, relative to `parlab/`), and
its collect step runs the student's code inside `library_calls(LIBRARY)`:

    with library_calls(LIBRARY) as called:
        answer(...)
    called  # ["schemes/tensor_parallel.py: CopyToTensorParallel.forward", ...]

The names travel to the grader as plain strings; `library_line` makes the verdict: PASS when the list is empty, else
a FAIL line naming the first calls. The hook is Python's profiler (`sys.setprofile`): whatever way the function was
reached (an import, a module attribute, a subclass, a copy of its code object), a call whose code lives in one of
those files is seen. Building blocks a lab hands out (`parlab.core`: comm, models, check) are never on the list.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import parlab

PACKAGE = os.path.dirname(os.path.realpath(parlab.__file__))


def _covered(path: str, roots: tuple[str, ...]) -> str | None:
    """`path` relative to the package when it lies in one of `roots` (files, or folders ending in '/')."""
    real = os.path.realpath(path)
    if not real.startswith(PACKAGE + os.sep):
        return None
    relative = os.path.relpath(real, PACKAGE).replace(os.sep, "/")
    for root in roots:
        if relative == root or (root.endswith("/") and relative.startswith(root)):
            return relative
    return None


@contextmanager
def library_calls(library: Sequence[str]) -> Iterator[list[str]]:
    """Record the calls into the package files `library` (e.g. "schemes/tensor_parallel.py", "schemes/sequence/")
    made inside the block, by this thread and by threads started in it: "file: qualified function name", once each."""
    roots = tuple(library)
    seen: list[str] = []
    known: dict[str, str | None] = {}

    def profile(frame, event, arg):
        # Only functions count: a module's or a class's body runs when the file is imported, which calls nothing,
        # and a generator expression or lambda inside a library function is seen as that function.
        if event != "call" or not frame.f_code.co_flags & inspect.CO_OPTIMIZED or "<" in frame.f_code.co_name:
            return
        filename = frame.f_code.co_filename
        if filename not in known:
            known[filename] = _covered(filename, roots)
        where = known[filename]
        if where is not None:
            name = f"{where}: {getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"
            if name not in seen:
                seen.append(name)

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)


def library_line(what: str, called: Sequence[str], library: str = "the library's implementation") -> str:
    """The verdict on the calls `library_calls` saw: PASS when none, else FAIL naming the first three."""
    text = f"{what}: no call into {library}"
    if not called:
        return f"{text}: PASS"
    names = sorted(set(called))
    shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    return f"{text}: called {shown}: FAIL"
