"""What comes back from the ranks, and what the parent says meanwhile (issue 41, items 16, 18, 19)."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

import parlab
from parlab.runtime.progress import _ProgressLine


def _cyclic():
    x = [1, dist.get_rank()]
    x.append(x)
    return x


def _nested_too_deep():
    x: list = []
    for _ in range(50_000):
        x = [x]
    return x


def test_a_list_that_holds_itself_comes_back_with_its_cycle():
    """Item 18: tensors are moved to the CPU by walking the value, which recursed for ever on a cycle (a 2984-line
    RecursionError); pickle itself sends cycles."""
    results = parlab.launch(_cyclic, 2, echo=False)
    assert [r[:2] for r in results] == [[1, 0], [1, 1]] and all(r[2] is r for r in results)


def test_a_value_nested_too_deep_to_send_is_said_in_one_line():
    with pytest.raises(parlab.RankError) as failed:
        parlab.launch(_nested_too_deep, 2, echo=False)
    text = str(failed.value)
    assert "cannot be sent back to the parent: it is nested more than" in text and len(text.splitlines()) < 10, text


def _forks_and_both_return():
    pid = os.fork()
    if pid == 0:  # the child returns from the rank function too, into parlab's rank code
        return "child"
    time.sleep(0.5)  # the child's value would have arrived first
    os.waitpid(pid, 0)
    return "parent"


def test_only_the_ranks_own_process_reports_its_value():
    """Item 18: a rank that forked and whose child also returned came back as ['child', 'child']."""
    assert list(parlab.launch(_forks_and_both_return, 2, echo=False)) == ["parent", "parent"]


def _sleeps(seconds: float) -> int:
    time.sleep(seconds)
    return dist.get_rank()


def test_a_long_launch_says_it_is_alive_where_stderr_is_no_terminal(monkeypatch, capsys):
    """Item 16: in a pipe or a log a long run was silent until it ended. With LINES on (the command line's `run`
    and `tour`), a line comes within 2 s, then one at most every 10 s, then the last state."""
    parlab.launch(_sleeps, 2, 0.0, echo=False)  # a warm rank server
    monkeypatch.setattr(_ProgressLine, "LINES", True)
    started = time.perf_counter()
    stamps = []
    real_write = _ProgressLine._show_line

    def timed(self, final):
        real_write(self, final)
        stamps.append(time.perf_counter() - started)

    monkeypatch.setattr(_ProgressLine, "_show_line", timed)
    assert list(parlab.launch(_sleeps, 2, 3.0, echo=False)) == [0, 1]
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("parlab: ") for line in lines), lines
    assert "2/2 ranks started" in lines[0] and len(lines) <= 2, lines  # 3 s: the first line and the final one
    assert min(stamps) < 2.5  # the first look after the 2 s delay (ticks every 0.25 s)


def test_live_in_a_plain_script_saves_the_timeline_and_says_where(tmp_path, monkeypatch, capsys):
    """Item 19: outside a notebook parlab.live drew nothing and said nothing."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    results = parlab.live(_sleeps, 2, 0.0)
    assert list(results) == [0, 1]
    err = capsys.readouterr().err.strip().splitlines()
    (saved,) = tmp_path.glob("parlab-live-*.html")
    assert (
        err[-1] == f"parlab.live: no notebook to draw in here; the timeline is saved in {saved} (open it in a browser)"
    )
    assert "_sleeps on 2 ranks" in saved.read_text() and "plotly" in saved.read_text()
