"""Kernel side of the library-call guard (parlab/grading/labs/guard.py): the calls a notebook's own cells make.

A check runs a student's functions inside `guard.library_calls`, on the ranks or in the kernel. A `# PREDICT:` cell
is different: its numbers are computed when the cell runs, and the check only receives the numbers. To see whether
they came from the library's own theory (lab 06's `offload_memory(...)`, lab 01's bucket plan), a lab's setup cell
starts a watch on the kernel's thread:

    watch = NotebookWatch(LIBRARY)
    watch.start()                  # setup cell: from here on, calls into LIBRARY from the notebook's cells are noted
    with watch.paused():           # a check cell: the check's own calls are not the student's
        ...
    watch.calls                    # ["schemes/zero/theory.py: offload_memory", ...]
    watch.stop()                   # once the predictions are checked: the kernel runs without a profile hook again

Importing a module (its `<module>` code, its class bodies) is not a call of its implementation: only functions are
noted. The hook is Python's
profiler, as in guard.py; it only ever runs in the kernel (ranks are other processes).
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from parlab.grading.labs.guard import _covered


class NotebookWatch:
    """The calls into `library` (files or folders relative to parlab/) made on the kernel's thread while started and
    not paused, once each, as "file: qualified name"."""

    def __init__(self, library: Sequence[str]):
        self.library = tuple(library)
        self.calls: list[str] = []
        self._profile = None

    def start(self) -> None:
        self.stop()
        roots, known, seen = self.library, {}, []

        def profile(frame, event, arg):
            if event != "call":
                return
            code = frame.f_code
            if code.co_filename not in known:
                known[code.co_filename] = _covered(code.co_filename, roots)
            where = known[code.co_filename]
            # a function (not a module or class body; not a comprehension, whose function is noted already)
            if where is not None and code.co_flags & inspect.CO_OPTIMIZED and not code.co_name.startswith("<"):
                name = f"{where}: {getattr(code, 'co_qualname', code.co_name)}"
                if name not in seen:
                    seen.append(name)

        self.calls, self._profile = seen, profile
        sys.setprofile(profile)
        threading.setprofile(profile)

    def stop(self) -> None:
        """Remove the hook (if it is still the one installed)."""
        if self._profile is not None:
            if sys.getprofile() is self._profile:
                sys.setprofile(None)
            if threading.getprofile() is self._profile:
                threading.setprofile(None)
        self._profile = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the block nothing is noted (and guard.library_calls may install its own hook)."""
        active = self._profile is not None and sys.getprofile() is self._profile
        if active:
            sys.setprofile(None)
            threading.setprofile(None)
        try:
            yield
        finally:
            if active and self._profile is not None:
                sys.setprofile(self._profile)
                threading.setprofile(self._profile)
