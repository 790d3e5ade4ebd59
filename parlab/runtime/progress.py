"""The progress a launch shows while its ranks run (a bar in a notebook, a line in a terminal)."""

from __future__ import annotations

import os
import sys
import time
from html import escape as html_escape


class _ProgressLine:
    """Progress of a launch longer than 1 s ("4/4 ranks started, step 3/10 after 5 s"), where someone watches.

    In a notebook: an HTML progress bar under the cell, updated in place, and emptied once the ranks report. It is
    HTML only, which nbval does not compare (conftest.py), because its figures depend on timing; under pytest it is
    not shown at all. In a terminal: one line on stderr, rewritten in place. Where stderr is no terminal (a pipe, a
    log) and LINES is on (the command line turns it on for `run` and `tour`: a long run must say it is alive
    wherever it is read): whole lines, "parlab: ...", the first after LINE_DELAY seconds, then at most one every
    LINE_EVERY seconds.
    """

    DELAY = 1.0  # seconds before the progress appears: quick launches stay silent
    FORCE: bool | None = None  # tests set True (show on stderr even without a terminal) or False
    LINES = False
    LINE_DELAY, LINE_EVERY = 2.0, 10.0

    def __init__(self, world_size: int):
        self.world_size, self.started, self.steps = world_size, set(), {}
        self.began, self.last, self.handle = time.perf_counter(), None, None
        self.waiting = ""  # the longest wait in a traced call, in words (set by launch)
        self.starting = False  # the rank server is still starting (importing torch): no rank can start yet
        self.notebook = _in_notebook() and "PYTEST_CURRENT_TEST" not in os.environ
        watched = self.notebook or sys.stderr.isatty()
        self.lines = self.LINES and self.FORCE is None and not watched
        self.line_at: float | None = None  # when the last whole line was written
        self.enabled = (watched if self.FORCE is None else self.FORCE) or self.lines

    def update(self, update: dict) -> None:
        if update.get("started"):
            self.started.add(update["rank"])
        else:
            self.steps[update["rank"]] = update

    def _state(self) -> tuple[str, int, int]:
        """(text, done, total) for the slowest rank."""
        if self.starting:
            return f"starting the rank server (importing torch) for {time.perf_counter() - self.began:.0f} s", 0, 1
        text = f"{len(self.started)}/{self.world_size} ranks started"
        done, total = len(self.started), self.world_size
        if self.steps:
            slowest = min(self.steps.values(), key=lambda u: u["done"])
            text += f", {slowest['what']} {slowest['done']}/{slowest['total']}"
            done, total = slowest["done"], slowest["total"]
        text += f" after {time.perf_counter() - self.began:.0f} s"
        if self.waiting:  # a rank stuck in a call: say which while it lasts
            text += f"; {self.waiting}"
        return text, done, total

    def show(self, final: bool = False) -> None:
        if not self.enabled or (time.perf_counter() - self.began < self.DELAY and not final):
            return
        if self.lines:
            self._show_line(final)
            return
        text, done, total = self._state()
        if text == self.last and not final:
            return
        self.last = text
        if self.notebook and self.FORCE is None:
            self._show_html(text, done, total)
        else:
            sys.stderr.write("\r" + text + ("\n" if final else ""))
            sys.stderr.flush()

    def _show_line(self, final: bool) -> None:
        """A whole line on stderr (no terminal to rewrite one in place), now and then."""
        now = time.perf_counter()
        due = now - self.began >= self.LINE_DELAY and (self.line_at is None or now - self.line_at >= self.LINE_EVERY)
        if not due and not (final and self.line_at is not None):
            return
        text = self._state()[0]
        if text != self.last:
            sys.stderr.write(f"parlab: {text}\n")
            sys.stderr.flush()
        self.last, self.line_at = text, now

    def _show_html(self, text: str, done: int, total: int) -> None:
        from IPython.display import display

        html = {
            "text/html": f'<div style="font: 13px monospace; color: #555"><progress value="{done}" max="{total}" '
            f'style="width: 12em; vertical-align: middle"></progress> {html_escape(text)}</div>'
        }
        if self.handle is None:
            self.handle = display(html, raw=True, display_id=True)
        else:
            self.handle.update(html, raw=True)

    def close(self, reported: bool = False) -> None:
        """The launch is over. reported: its ranks sent their report (what the cell prints next says how it went);
        a notebook's bar then goes (a stored lesson and its slides keep no "after 6 s" per launch); otherwise, and
        in a terminal, the final state stays."""
        if self.last is None:  # never shown
            return
        if reported and self.handle is not None:
            self.handle.update({"text/html": ""}, raw=True)  # HTML, as the bar was: nbval compares neither
            return
        self.show(final=True)


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (where HTML output is displayed)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
